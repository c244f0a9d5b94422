"""Test-only, on the PYTHONPATH of the subprocesses that run kernels under TRITON_INTERPRET=1 (see
tests/triton_interpreter.py): Triton 3.5's interpreter turns a loop bound into ``int(ndarray)`` of a one-element
array, which numpy 2.4 refuses. Its tensors' ``__index__`` reads the element instead; nothing else changes."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import inspect

        import numpy as np
        from triton.runtime import interpreter as _interpreter

        _patch_lang_tensor = _interpreter._patch_lang_tensor

        def _patch_lang_tensor_index(tensor):  # noqa: ANN001, ANN202 - triton.language.tensor
            _patch_lang_tensor(tensor)
            tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])

        # only the one-argument form of Triton 3.5; later ones patch through a scope and squeeze the array themselves
        if len(inspect.signature(_patch_lang_tensor).parameters) == 1:
            _interpreter._patch_lang_tensor = _patch_lang_tensor_index
    except Exception:  # noqa: BLE001 - another Triton: the probe says whether the interpreter runs
        pass
