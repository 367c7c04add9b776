"""nginx twice over: the near-free upstream (`return 200`) and the reverse-proxy floor.

Owns: both configs and starting nginx in the foreground with everything (pid file, logs,
temp paths) under the run's temporary directory, listening on 127.0.0.1 only. Must never:
touch the system's nginx service, /etc/nginx, or listen beyond loopback.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from payloads import CHAT_RESPONSE
from servers import Managed, wait_port

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"

_COMMON = """
daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  keepalive_requests 1000000;
  keepalive_timeout 120s;
  {body}
}}
"""

_UPSTREAM = """
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    # `return` discards the request body; no size limit so 4 MB prompts are read and dropped.
    client_max_body_size 0;
    location / {{
      default_type application/json;
      return 200 '{response}';
    }}
  }}
"""

_PROXY = """
  upstream backend {{
    server 127.0.0.1:{upstream_port};
    keepalive 128;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    client_max_body_size 64m;
    client_body_buffer_size 64m;
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      # Relay SSE as it arrives, like the Python proxies do.
      proxy_buffering off;
    }}
  }}
"""


def _prepare(workdir: Path, body: str) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (workdir / sub).mkdir(exist_ok=True)
        # Workers drop to an unprivileged user when the master runs as root.
        os.chmod(workdir / sub, 0o777)
    os.chmod(workdir, 0o755)
    conf = workdir / "nginx.conf"
    conf.write_text(_COMMON.format(dir=workdir, body=body))
    return conf


def _response_literal() -> str:
    text = CHAT_RESPONSE.decode()
    if "'" in text or "\\" in text:
        raise ValueError("the fixed reply cannot be quoted for nginx")
    return text


def start_upstream(workdir: Path, port: int, *, cpu: int | None) -> Managed:
    conf = _prepare(workdir, _UPSTREAM.format(port=port, response=_response_literal()))
    m = Managed(
        "nginx-upstream",
        [NGINX, "-c", str(conf), "-p", str(workdir)],
        cpu=cpu,
        log=workdir / "stderr.log",
    ).start()
    wait_port(port, proc=m)
    return m


def start_proxy(workdir: Path, port: int, upstream_port: int, *, cpu: int | None) -> Managed:
    conf = _prepare(workdir, _PROXY.format(port=port, upstream_port=upstream_port))
    m = Managed(
        "nginx", [NGINX, "-c", str(conf), "-p", str(workdir)], cpu=cpu, log=workdir / "stderr.log"
    ).start()
    wait_port(port, proc=m)
    return m
