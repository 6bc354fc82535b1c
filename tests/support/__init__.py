"""What the tests share, imported as ``support`` (pyproject.toml puts ``tests/`` on pytest's path; no test module imports
another, nor a benchmark):

* the one float64 reference and its comparison (``reference64``), and the one tolerance rule (``tolerances``);
* input and model builders (``fuzz_cases``, ``hf_models``, ``lightning_models``) and whole-model gradients
  (``model_gradients``);
* CPU stand-ins for cuDNN (``served_on_cpu``, ``emulated_cudnn``, ``provider_cpu``) and the GPU tests' checks
  (``gpu_checks``, ``sync_debug``);
* other processes: fresh interpreters (``child_process``), the fuzz workers and their driver (``fuzz_worker``,
  ``fuzz_runner``), and the benchmark scripts (``benchmark_scripts``).
"""
