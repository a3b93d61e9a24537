"""EntMTP: entropy-guided multi-token prediction over Hydra-style draft heads.

The engine works on token ids; text, chat templates and printing live at the edges
(`entmtp.__main__` and `app.py`).

The code is a stack of floors (`LAYERS`, the one statement of the order; DESIGN.md *Layers*
shows it and `tests/test_layers.py` enforces it): a module imports only from a lower floor or
from within its own package, and never in a circle.
"""

__version__ = "0.1.0"

# floor -> the top-level modules and packages of `entmtp` on it, lowest first
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config",),  # every default, once
    ("machine", "data"),  # which machine this is; prompt sets, splits and stored answers
    ("model",),  # GGUF linears and the extension, KV cache, decoder forward, CUDA graphs, the cache dispatcher
    ("spec",),  # trees, policies, heads, drafting, verification, the decode loop
    ("bank",),  # bank files, traces and simulation, recording, fitting, calibration, building
    ("runtime", "figures"),  # resolution of models/heads/banks and the facade that runs a method; Plotly figures
    ("tools", "app"),  # bench, report, train-heads, eval-heads, kernels; the race behind the app
    ("__main__",),  # the CLI
)
