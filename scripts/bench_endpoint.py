"""Benchmark: the endpoint teacher against ``mlx_lm.server`` on loopback, and its overhead over a
bare HTTP loop.

Starts ``mlx_lm.server`` with a tiny random model (``mlx_ssp.testing.make_tiny_model``) on
127.0.0.1, warms it up, then for each concurrency (default 1, 4, 16) runs, alternately
``--repeats`` times on the same N tasks x K samples:

- ``ours``: :func:`mlx_ssp.rollout.endpoint.iter_endpoint_rollouts` (request building, the ``n``
  probe and fallback, records, verification with the ``exact`` verifier), no file writes;
- ``bare``: the same request bodies (same messages, sampling and seeds, one sample per request as
  the fallback sends them) POSTed by ``urllib`` from a thread pool of the same width, replies parsed
  and nothing else.

The two alternate in short blocks (4 x concurrency requests, at least 32, each; the order flipping
from block to block) so that a shared machine's load drifts over both alike. Prints completions/s and
completion tokens/s (the server's ``usage``) of each over all blocks, and ours' overhead per
completion token, over the totals and as the median of the blocks' ratios. mlx_lm.server honours
the per-request seed, so both sides decode the same tokens. Compare rows of one run only.

    python scripts/bench_endpoint.py
    python scripts/bench_endpoint.py --server stub --tasks 200   # the client's own cost per request
    python scripts/bench_endpoint.py --tasks 32 --k 4 --max-tokens 32 --concurrency 1 4 16 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: ``--server stub``: a reply in microseconds, so what is left is the client's own cost per request
STUB = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_POST(self):
        b = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        raw = json.dumps({"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant",
              "content": "Answer: 1"}}], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw))); self.end_headers(); self.wfile.write(raw)
    def do_GET(self):
        self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers()
ThreadingHTTPServer.request_queue_size = 256
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def start_server(model: Path, port: int, decode_concurrency: int, kind: str) -> subprocess.Popen:
    cmd = ([sys.executable, "-c", STUB, str(port)] if kind == "stub" else
           [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--decode-concurrency", str(decode_concurrency)])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit("the server exited") from None
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def run_ours(cfg, request) -> tuple[float, int, int]:
    from mlx_ssp.rollout.endpoint import iter_endpoint_rollouts

    stats: dict = {}
    t0 = time.perf_counter()
    n = sum(len(g) for g in iter_endpoint_rollouts(cfg.model_copy(update={"use_n": False}), request, stats=stats))
    return time.perf_counter() - t0, n, stats["gen_tokens"]


def run_bare(url: str, bodies: list[dict], concurrency: int) -> tuple[float, int, int]:
    def post(body):
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(post, bodies))
    dt = time.perf_counter() - t0
    return dt, sum(len(r["choices"]) for r in replies), sum(r["usage"]["completion_tokens"] for r in replies)


def bare_bodies(request, model: str) -> list[dict]:
    """The bodies ``ours`` sends with one sample per request (the fallback mlx_lm.server gets)."""
    from mlx_ssp.rollout.endpoint import sampling_body, task_messages
    from mlx_ssp.sampling import sample_stream_seed

    base = sampling_body(request.sampling)
    return [{"model": model, **base, "messages": task_messages(t, request.system),
             "seed": sample_stream_seed(request.seed, t.id, s) % (2 ** 31)}
            for t in request.tasks for s in range(request.k)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=1, help="passes over the tasks")
    ap.add_argument("--decode-concurrency", type=int, default=32, help="mlx_lm.server's batch width")
    ap.add_argument("--server", choices=["mlx_lm", "stub"], default="mlx_lm",
                    help="stub: a server that answers at once (the client's own overhead)")
    args = ap.parse_args()

    from mlx_ssp.rollout import RolloutRequest, SamplingConfig
    from mlx_ssp.rollout.endpoint import EndpointTeacherConfig
    from mlx_ssp.rollout.endpoint_client import chat_url
    from mlx_ssp.tasks import Task
    from mlx_ssp.testing import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_endpoint_"))
    model = make_tiny_model(tmp / "tiny", "qwen3")
    port = free_port()
    server = start_server(model, port, args.decode_concurrency, args.server)
    url = f"http://127.0.0.1:{port}"
    try:
        tasks = [Task(id=f"t{i}", domain="add", prompt=f"What is {i} + {i + 1}?", answer=str(2 * i + 1),
                      verifier="exact") for i in range(args.tasks)]
        request = RolloutRequest(tasks=tasks, k=args.k, progress=False, seed=0,
                                 sampling=SamplingConfig(temperature=1.0, max_tokens=args.max_tokens))
        bodies = bare_bodies(request, "default_model")
        run_bare(chat_url(url), bodies[:4], 4)  # warm-up: the server loads the model on the first request
        # and ours' first call imports the verifiers
        run_ours(EndpointTeacherConfig(endpoint=url, model="default_model"), request.replace(tasks=tasks[:1]))
        rows = []
        for c in args.concurrency:
            cfg = EndpointTeacherConfig(endpoint=url, model="default_model", concurrency=c)
            # short alternating blocks (4c requests, at least 32, each), so that the load of a shared machine
            # drifts over both sides alike; the order inside a pair alternates too
            per = max(1, (max(4 * c, 32) + args.k - 1) // args.k)  # tasks per block (at least 32 requests)
            tot = {"ours": [0.0, 0, 0], "bare": [0.0, 0, 0]}
            ratios = []
            for rep in range(args.repeats):
                for j, i in enumerate(range(0, len(tasks), per)):
                    sub = request.replace(tasks=tasks[i:i + per])
                    sides = {"ours": lambda: run_ours(cfg, sub),
                             "bare": lambda: run_bare(chat_url(url), bare_bodies(sub, "default_model"), c)}
                    got = {}
                    for name in (("ours", "bare") if (rep + j) % 2 == 0 else ("bare", "ours")):
                        got[name] = sides[name]()
                        tot[name] = [a + b for a, b in zip(tot[name], got[name])]
                    o, b = got["ours"], got["bare"]
                    ratios.append((o[0] / max(o[2], 1)) / (b[0] / max(b[2], 1)) - 1)
            (os_, on, ot), (bs, bn, bt) = tot["ours"], tot["bare"]
            rows.append({"concurrency": c, "ours_completions_s": round(on / os_, 2), "ours_tok_s": round(ot / os_, 1),
                         "ours_ms_per_request": round(1000 * os_ / on, 3),
                         "bare_ms_per_request": round(1000 * bs / bn, 3),
                         "bare_completions_s": round(bn / bs, 2), "bare_tok_s": round(bt / bs, 1),
                         "overhead_total": round((os_ / max(ot, 1)) / (bs / max(bt, 1)) - 1, 4),
                         "overhead_block_median": round(statistics.median(ratios), 4), "blocks": len(ratios),
                         "completions_each": on})
            print(json.dumps(rows[-1]), flush=True)
        print(json.dumps({"machine": f"{platform.machine()} {platform.system()} {platform.python_version()}",
                          "tasks": args.tasks, "k": args.k, "max_tokens": args.max_tokens, "repeats": args.repeats,
                          "decode_concurrency": args.decode_concurrency, "server": args.server}))
        print("| concurrency | ours completions/s | ours tok/s | bare completions/s | bare tok/s | overhead (total) |"
              " overhead (block median) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['concurrency']} | {r['ours_completions_s']} | {r['ours_tok_s']} | {r['bare_completions_s']} | "
                  f"{r['bare_tok_s']} | {100 * r['overhead_total']:+.1f}% | {100 * r['overhead_block_median']:+.1f}% |")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
