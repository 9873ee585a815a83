"""GPU profiles (``kvengine-profile`` files) built from published measurements, for simulating
GPUs this repository does not run on; ``build_gpu_profiles`` makes them and says how."""
