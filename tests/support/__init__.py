"""What the tests share: the float64 reference (``reference64``), the one tolerance rule (``tolerances``), input and model
builders (``hf_models``, ``lightning_models``, ``fuzz_cases``), CPU stand-ins for cuDNN (``served_on_cpu``,
``emulated_cudnn``, ``provider_cpu``), and running code in other processes (``child_process``, ``fuzz_worker``,
``fuzz_runner``). Imported as ``support`` (pyproject.toml puts ``tests/`` on pytest's path); no test module imports another."""
