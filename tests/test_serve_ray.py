"""Scale-out on Ray Serve: a local Ray instance, 2 replicas of the server behind Ray's HTTP proxy,
requests over HTTPS (TLS at Ray's proxy) through the official openai client with an API key
(401 without). Runs in a network namespace with only loopback
(``unshare -rn``), because Ray's gRPC servers listen on all interfaces whatever the node address."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'specdec-rt[ray]')")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'specdec-rt[ray]')")
pytest.importorskip("openai")

CHECK = Path(__file__).with_name("ray_serve_check.py")


def _loopback_namespace() -> list[str] | None:
    """The command prefix that runs a process in a fresh network namespace (only lo), or None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in ([unshare, "-rn"], [unshare, "-n"]):
        try:
            r = subprocess.run([*prefix, sys.executable, "-c", "pass"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return prefix
    return None


def test_two_replicas_behind_ray_serve(tiny_pair, tiny_gen, tmp_path):
    prefix = _loopback_namespace()
    if prefix is None:
        pytest.skip("cannot create a loopback-only network namespace (unshare -rn); Ray's gRPC servers would "
                    "listen on every interface, so the Ray test does not run here")
    out = tmp_path / "report.json"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([*prefix, sys.executable, str(CHECK), str(tiny_pair["bundle"]), str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rep = json.loads(out.read_text())
    assert rep["interfaces"] == ["lo"]
    assert rep["replicas_running"] == 2
    assert rep["models"] == ["tiny"]
    for prompt, (text, n) in rep["completions"].items():
        want = tiny_gen.generate(prompt, max_new_tokens=16, temperature=0)
        assert text == want.text and n == len(want.token_ids)
        assert rep["streamed"][prompt] == want.text
    assert rep["url"].startswith("https://")  # TLS at Ray's HTTP proxy (http_options ssl_keyfile / ssl_certfile)
    assert rep["unauthenticated"] == [401, 401]  # keys (ServerConfig.api_keys) checked in the replicas
    status, body = rep["bad_request"]
    assert status == 400 and body["error"]["param"] == "n"
    assert rep["health_pids"] == 2  # both replicas answered
    assert rep["metrics_ok"]
    assert rep["total_s"] < 240


def test_ray_entry_point_checks_security_options_first(tmp_path, capsys):
    """python -m specdec_rt.serve_ray takes specdec-serve's key and TLS options, checked before Ray
    starts (TLS then goes to Ray's HTTP proxy: serve.start(http_options=...))."""
    from specdec_rt.serve_ray import main

    with pytest.raises(SystemExit) as exc:
        main(["--bundle", str(tmp_path), "--ssl-certfile", str(tmp_path / "cert.pem")])
    assert exc.value.code == 2 and "go together" in capsys.readouterr().err
    assert main(["--bundle", str(tmp_path), "--api-key-file", str(tmp_path / "none")]) == 1
    assert capsys.readouterr().err.startswith("error: cannot read --api-key-file")
