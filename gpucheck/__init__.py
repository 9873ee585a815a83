"""The GPU check: every CUDA path of the project and the GPU figures, in one capped run.

    bash scripts/gpu_check.sh [--out DIR]              # on a CUDA machine (offline: .gpu_wheels/)
    .venv/bin/python -m gpucheck --cpu-selftest --out DIR   # the same driver on CPU
    GPU_WHEELS_DIR=.gpu_wheels_ucx bash scripts/gpu_check.sh --sections env ucx_cuda
                                  # UCX's own run (wheels: scripts/gpu_wheels.sh --ucx)

Sections, in order (``--sections``/``--skip`` choose; ``python -m gpucheck --list``):

==============  ====  =============================================================
section         cap   what it shows
==============  ====  =============================================================
env               20  machine, versions, which kernels load
triton_kernel     40  the Triton decode kernel compiled, against the dense reference
engine_greedy     80  ModelRunner greedy == transformers greedy, same device and dtype
                      (tiny llama/qwen2/qwen3 and SmolLM2-shaped; float32 and bfloat16)
staging           20  connector loads/saves reuse pinned staging buffers (no allocation)
gpu_tier          15  the store's GPU tier takes demotions, spills to SSD, serves gets
client_cuda       15  the client puts/gets CUDA tensors through the daemon (shm, TCP)
disagg            70  prefill worker -> store -> decode worker == colocated; corrupt and
                      missing blocks recomputed (gpucheck.disagg)
store_load        30  124 blocks (87 MiB) into a CUDA paged cache vs CPU verify + one
                      pinned copy, and the bare pinned copy (gpucheck.figures)
vllm_layout       30  the vLLM connector's saves and staged loads on FlashAttention- and
                      head-major-shaped device caches, bit-exact, vs a bare pinned copy
                      (gpucheck.vllm_layout)
decode_tps        50  decode tokens/s at batch 1/32/128, ours vs transformers, bf16
prefill_tps       30  prefill tokens/s at 512/4096 tokens, ours vs transformers, bf16
cuda_ipc          30  hook: the CUDA IPC check (gpucheck.hooks)
ucx_cuda          40  124 blocks from CUDA tensors in a child process into this one's as ucxx
                      tagged messages, bit-exact, vs an in-process device copy, and the UCX
                      transports used (gpucheck.ucx_cuda); ucxx is not in the
                      device image: a run of its own, ``scripts/gpu_wheels.sh --ucx``
profile          240  hook: ``kvengine profile`` on SmolLM2-, then Llama-3-8B-shaped models,
                      with whatever time the budget has left
==============  ====  =============================================================

Each section has a time cap (seconds) and the whole run a budget (``--budget``, 300 s); a section
records one status: ``pass``, ``fail``, ``unsupported`` (the machine cannot: no CUDA, IPC in a
VM; its own result, neither pass nor fail), ``skipped-for-time`` (its cap or the budget ran out;
what it measured so far is kept), or ``not-implemented`` (a hook nobody has filled yet).

Output (``--out``, default ``results/gpu_check``): ``gpu_check.json`` — ``{"mode": "cuda" |
"cpu-selftest", "device", "budget_s", "elapsed_s", "summary": {status: count}, "sections": [{"name",
"status", "reason", "seconds", "cap_s", "doc", "details"}]}``, rewritten after every section so a
killed run leaves what it had — and ``gpu_check.log``, the console lines. Exit status 0 when no
section failed, 1 when one did, 3 when the watchdog ended a hung section. Nothing here is
downloaded or read from a model hub: checkpoints are generated on the device
(``gpucheck.models``).
"""
