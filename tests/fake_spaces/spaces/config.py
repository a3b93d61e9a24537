"""The one setting of the real package's `spaces.config.Config` the app reads."""


class Config:
    zero_gpu = True
