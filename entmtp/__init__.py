"""EntMTP: entropy-guided multi-token prediction over Hydra-style draft heads.

The engine works on token ids; text, chat templates and printing live at the edges
(`entmtp.__main__` and `app.py`).
"""

__version__ = "0.1.0"
