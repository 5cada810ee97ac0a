"""Run by tests/test_serve_ray.py inside a network namespace that has only loopback (``unshare -rn``):
a local Ray instance, 2 replicas of the server behind Ray Serve's HTTP proxy (HTTPS with a
certificate made here, an API key checked in the replicas), requests through it.

    python tests/ray_serve_check.py BUNDLE OUT.json

Ray's gRPC servers listen on all interfaces whatever the node address; in this namespace the only
interface is ``lo``, so nothing is reachable from outside the machine. Writes a JSON report.
"""
from __future__ import annotations

import fcntl
import json
import shutil
import socket
import ssl
import struct
import sys
import tempfile
import time
from pathlib import Path


KEY = "sk-ray-0123456789"


def loopback_up() -> None:
    """``ip link set lo up`` without iproute2 (a new network namespace starts with lo down)."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def interfaces() -> list[str]:
    return sorted(name for _, name in socket.if_nameindex())


def main(bundle: str, out_path: str) -> int:
    loopback_up()
    report: dict = {"interfaces": interfaces()}
    t0 = time.monotonic()
    import httpx
    import openai
    import ray
    from ray import serve

    from specdec_rt.serve_ray import build_app
    from specdec_rt.serving import ServerConfig
    from specdec_rt.serving.auth import APIKeys

    from helpers import make_certificate

    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's unix sockets live under it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=tmp,
             log_to_driver=False, configure_logging=False)
    try:
        cert, key = make_certificate(Path(tmp))  # TLS terminated by Ray's HTTP proxy
        serve.start(http_options={"host": "127.0.0.1", "port": port, "ssl_keyfile": str(key),
                                  "ssl_certfile": str(cert)})
        ca = ssl.create_default_context(cafile=str(cert))
        config = ServerConfig(model_name="tiny", api_keys=APIKeys([KEY]))
        serve.run(build_app(bundle, num_replicas=2, config=config, threads=1, replica_cpus=0.5), name="specdec",
                  route_prefix="/")
        report["startup_s"] = time.monotonic() - t0
        app_status = serve.status().applications["specdec"]
        report["replicas_running"] = sum(
            n for d in app_status.deployments.values() for state, n in d.replica_states.items()
            if str(getattr(state, "value", state)) == "RUNNING")
        url = report["url"] = f"https://127.0.0.1:{port}"
        http = httpx.Client(verify=ca, timeout=60)
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120,
                          http_client=httpx.Client(verify=ca))
        auth = {"Authorization": f"Bearer {KEY}"}
        report["unauthenticated"] = [http.post(url + "/v1/completions", json={"prompt": "x"}).status_code,
                                     http.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code]
        report["models"] = [m.id for m in c.models.list().data]
        report["completions"] = {}
        report["streamed"] = {}
        for prompt in ("def wrap(text, width):", "import heapq\n", "class Stack:"):
            out = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
            report["completions"][prompt] = [out.choices[0].text, out.usage.completion_tokens]
            chunks = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True)
            report["streamed"][prompt] = "".join(ch.choices[0].text for ch in chunks)
        r = http.post(url + "/v1/completions", json={"prompt": "x", "n": 2}, headers=auth)
        report["bad_request"] = [r.status_code, r.json()]
        pids = set()
        for _ in range(30):
            h = http.get(url + "/health")
            pids.add(h.json()["pid"])
        report["health_pids"] = len(pids)
        report["metrics_ok"] = "specdec:generation_tokens_total" in http.get(url + "/metrics").text
        c.close()
        http.close()
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    report["total_s"] = time.monotonic() - t0
    with open(out_path, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
