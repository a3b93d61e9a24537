"""`python tests/fake_spaces/serve.py`: app.py as a ZeroGPU Space would run it, under the fake
`spaces` package, with the model's forwards guarded (any outside a GPU call fails once the page is
served). Reads GRADIO_SERVER_PORT; logs GPU requests and violations to FAKE_SPACES_LOG."""

import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT)]

import spaces  # noqa: E402  (first, as on a Space)
import gradio as gr  # noqa: E402

from entmtp.model import forward  # noqa: E402

spaces.guard(forward, "forward", "block_forward")
_launch = gr.Blocks.launch


def launch(self, *args, prevent_thread_lock=False, **kwargs):
    out = _launch(self, *args, prevent_thread_lock=True, **kwargs)
    spaces.arm()
    if not prevent_thread_lock:
        self.block_thread()
    return out


gr.Blocks.launch = launch
os.chdir(ROOT)
runpy.run_path(str(ROOT / "app.py"), run_name="__main__")
