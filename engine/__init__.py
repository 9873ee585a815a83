"""The serving engine: model over a paged KV cache, scheduler, kvstore connector, worker.

Importing ``engine`` is cheap and torch-free; torch-using modules are imported on use::

    from engine.model.runner import ModelRunner, StepItem
    runner = ModelRunner(model_dir, num_blocks=256)
    logits = runner.execute([StepItem(token_ids=prompt, start_pos=0, block_table=[0, 1])])
"""
