"""The fault suite's long form: a real `specdec serve` under mixed load and injected faults.

Phases, each against a fresh `specdec serve` process (the model and flags given below):

  soak      N requests from C client threads: chat and completions, streamed and not, every
            speculation policy, greedy and sampled, malformed bodies, and clients that drop the
            connection mid-stream; the server's RSS and open file descriptors before and after.
  slow      clients that trickle a body or their headers (each must get a 408 and go), while
            normal requests are answered.
  drain     SIGTERM with requests in flight and queued: every one answered whole, exit 0.
  kill      SIGKILL at random moments while the suffix cache is being saved at exit: the file
            on disk is always a whole cache (loads) or absent, never damaged.

It prints one line per phase and a summary: requests, faults injected, 5xx answers, lost or
corrupted data. The README's "Faults" section carries a run's numbers.

    python benchmarks/fault_soak.py --target qwen2.5-coder-0.5b -n 300 -c 6
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPTS = [
    "Write a Python function that reverses a list.",
    "Explain what a hash map is in one sentence.",
    "def fib(n):",
    "List three prime numbers.",
]
POLICIES = [None, {"draft": "auto"}, {"draft": "ngram", "k": 6}, {"draft": "suffix"}, {"draft": "none"}]
MALFORMED = [b"{", b"[1]", b'{"prompt": "a\\ud800"}', b"[" * 50_000, b'{"messages": [], "max_tokens": 2}']


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = [sys.executable, "-m", "specdec.cli", "serve", "--target", args.target, "--draft", "auto"]
    command += ["--max-batch", str(args.rows), "--ctx", "2048", "--port", str(port), "--log-level", "error", *extra]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if request(port, "GET", "/health", None, timeout=2)[0] == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("the server did not come up in 600 s")


def request(port: int, method: str, path: str, body: bytes | None, timeout: float = 300, drop_after: int = 0):
    """(status, body bytes); `drop_after` > 0: read that many bytes of a stream, then close."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        r = conn.getresponse()
        data = r.read(drop_after) if drop_after else r.read()
        return r.status, data
    finally:
        conn.close()


def usage(pid: int) -> tuple[int, int]:
    """(RSS in MiB, open file descriptors) of a process."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) // 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def one(port: int, rng: random.Random, tally: dict, lock: threading.Lock) -> None:
    kind = rng.random()
    fault = ""
    if kind < 0.1:
        status, _ = request(port, "POST", "/v1/completions", rng.choice(MALFORMED))
        fault = "malformed"
        ok = status == 400
    else:
        chat = rng.random() < 0.5
        body: dict = {"max_tokens": rng.randint(4, 24), "temperature": rng.choice([0.0, 0.0, 0.8]), "seed": 1}
        prompt = rng.choice(PROMPTS)
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        policy = rng.choice(POLICIES)
        if policy:
            body["speculative"] = policy
        stream = rng.random() < 0.5
        body["stream"] = stream
        drop = rng.randint(40, 400) if stream and rng.random() < 0.3 else 0
        fault = "disconnect" if drop else ""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            status, data = request(port, "POST", path, json.dumps(body).encode(), drop_after=drop)
        except OSError as exc:
            status, data = 0, repr(exc).encode()
        if drop:
            ok = status == 200
        elif stream:
            ok = status == 200 and data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data
        else:
            ok = status == 200 and bool(json.loads(data)["choices"])
        if status == 429:  # the queue was full: a rule, not a fault
            ok = True
    with lock:
        tally["requests"] += 1
        tally["faults"] += bool(fault)
        tally["5xx"] += status >= 500
        tally["failed"] += not ok


def soak(args) -> dict:
    proc, port = start(args)
    request(port, "POST", "/v1/completions", json.dumps({"prompt": "warm up", "max_tokens": 4}).encode())
    before = usage(proc.pid)
    tally = {"requests": 0, "faults": 0, "5xx": 0, "failed": 0}
    lock = threading.Lock()
    counter = iter(range(args.n))

    def client(seed: int) -> None:
        rng = random.Random(seed)
        for _ in counter:
            one(port, rng, tally, lock)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(2)  # cancelled rows are freed within a step
    after = usage(proc.pid)
    status, metrics = request(port, "GET", "/metrics", None)
    running = [line for line in metrics.decode().splitlines() if line.startswith("specdec:num_requests_running")]
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    tally.update(
        seconds=round(time.monotonic() - started),
        rss_mib=f"{before[0]} -> {after[0]}",
        fds=f"{before[1]} -> {after[1]}",
        running_after=running[0].split()[-1] if running else "?",
        exit=code,
    )
    return tally


def slow(args) -> dict:
    """Half the slow clients send a body's first byte and stop (the body limit, 30 s, answers 408),
    half send their request headers a byte a second (the header limit, 10 s, answers 408)."""
    proc, port = start(args)
    bodies, headers = [], []
    for i in range(args.slow):
        s = socket.create_connection(("127.0.0.1", port))
        if i % 2 == 0:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            bodies.append(s)
        else:
            s.sendall(b"P")
            headers.append(s)
    trickle = b"OST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    stop = threading.Event()

    def drip() -> None:  # a byte a second on every header socket, until each is answered or closed
        for byte in trickle:
            if stop.wait(1.0):
                return
            for s in headers:
                try:
                    s.send(bytes([byte]))
                except OSError:
                    pass

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    status, _ = request(port, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 4}).encode())
    answered = {"body": 0, "headers": 0}
    for kind, socks in (("headers", headers), ("body", bodies)):
        for s in socks:
            s.settimeout(60)
            try:
                answered[kind] += s.recv(64).startswith(b"HTTP/1.1 408")
            except OSError:
                pass
            s.close()
    stop.set()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    return {
        "slow bodies": len(bodies),
        "answered 408 (body)": answered["body"],
        "slow headers": len(headers),
        "answered 408 (headers)": answered["headers"],
        "others served": status == 200,
        "exit": code,
    }


def drain(args) -> dict:
    proc, port = start(args)
    results: list = []

    def go(i: int) -> None:
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 32, "stream": i % 2 == 0}
        results.append(request(port, "POST", "/v1/completions", json.dumps(body).encode()))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(args.rows * 3)]  # rows busy, a queue
    for t in threads:
        t.start()
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join()
    code = proc.wait(120)
    whole = sum(s == 200 and (b"[DONE]" in d or b'"choices"' in d) and b'"error"' not in d for s, d in results)
    return {"requests in flight or queued": len(results), "answered whole": whole, "exit": code}


def kill_during_save(args) -> dict:
    from specdec.drafters.suffix import SuffixCacheDrafter

    folder = Path(tempfile.mkdtemp(prefix="specdec-soak-"))
    cache = folder / "suffix.npz"
    damaged = kills = 0
    rng = random.Random(7)
    for i in range(args.kills):
        proc, port = start(args, "--suffix-cache", str(cache))
        for prompt in PROMPTS[: 1 + i % len(PROMPTS)]:
            request(port, "POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 8}).encode())
        proc.send_signal(signal.SIGTERM)  # drains, then saves the cache
        time.sleep(rng.uniform(0.0, 0.6))
        proc.kill()
        proc.wait(30)
        kills += 1
        if cache.exists():
            try:
                SuffixCacheDrafter().load(cache)
            except Exception:
                damaged += 1
        damaged += sum(1 for p in folder.iterdir() if p.name.endswith(".tmp"))  # leftovers count as damage
    return {"kills": kills, "cache file damaged": damaged, "cache exists": cache.exists()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("-n", type=int, default=300, help="requests in the soak")
    p.add_argument("-c", "--clients", type=int, default=6)
    p.add_argument("--slow", type=int, default=50, help="slow clients: half trickle a body, half their headers")
    p.add_argument("--kills", type=int, default=10, help="SIGKILLs while the suffix cache is saved")
    p.add_argument("--phases", nargs="+", default=["soak", "slow", "drain", "kill"])
    args = p.parse_args()
    phases = {"soak": soak, "slow": slow, "drain": drain, "kill": kill_during_save}
    for name in args.phases:
        print(f"{name}: {phases[name](args)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
