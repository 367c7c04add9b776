"""SGLang's own preprocessing as the SGLang chat oracle (issue #47): `worker.py` runs in
SGLang's venv (`install.sh`, `make sglang-real`) and counts bodies with SGLang's code;
`client.py` starts it from the test venv and talks to it over a pipe. Neither imports
kvproxy: the worker is SGLang, the client only carries bytes."""
