"""Run Triton kernels on CPU under ``TRITON_INTERPRET=1`` in tests.

``enable()`` sets the variable (it must precede the kernel module's import: ``triton.jit`` reads it at
decoration time) and works around triton 3.6's interpreter with numpy >= 2.4: the interpreter holds scalars
as 1-element arrays and converts them with ``int(array)``, which numpy 2.4 rejects, so any ``range()`` over a
runtime bound fails. The patch converts through ``.item()`` instead and is applied only when needed.
"""

from __future__ import annotations

import os


def enable() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np

    try:
        int(np.zeros(1, dtype=np.int32))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_packed_encoders_compat", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._packed_encoders_compat = True
    interpreter._patch_lang_tensor = patched
