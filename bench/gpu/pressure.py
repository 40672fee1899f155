#!/usr/bin/env python3
"""GPU memory pressure while `ember serve` streams (issue 20, item 4), python3 stdlib only.

    python3 bench/gpu/pressure.py EMBER MODEL [serve args...]

Starts `ember serve -m MODEL --device cuda --reserve 6GiB` (plus the given args), then three
clients stream completions without pause while a second process (this script, through the
driver API with ctypes) takes GPU memory in steps until the GPU's free memory is 40, 12, 3 and
1 GiB (the last two below the server's 6 GiB reserve), holding each step for STEP_S seconds,
then gives it all back. Prints per step the free memory, the server's eviction counter and the
requests finished or failed meanwhile; then the server's tier log lines. Exits 1 if a request
failed or the server logged no eviction.
"""
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

EMBER, MODEL = sys.argv[1], sys.argv[2]
ARGS = sys.argv[3:]
STEP_S = float(os.environ.get("STEP_S", "10"))
GIB = 1 << 30

cuda = ctypes.CDLL("libcuda.so.1")
ctx = ctypes.c_void_p()
dev = ctypes.c_int()
assert cuda.cuInit(0) == 0
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0


def free_bytes():
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    assert cuda.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)) == 0
    return f.value


held = []


def take(n):
    p = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
    if rc == 0:
        held.append(p)
    return rc


def metrics(base):
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("ember_expert_") or line.startswith("ember_kv_pages"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


proc = subprocess.Popen(
    [EMBER, "serve", "-m", MODEL, "--port", "0", "--device", "cuda", "--reserve", "6GiB", *ARGS], stderr=subprocess.PIPE, text=True
)
base, log = None, []
t0 = time.time()
for line in proc.stderr:
    log.append(line)
    if "on http://" in line:
        base = "http://" + line.split("on http://", 1)[1].split()[0]
        break
if base is None:
    print("".join(log))
    sys.exit("the server did not start")
threading.Thread(target=lambda: [log.append(l) for l in proc.stderr], daemon=True).start()
print(f"server at {base} after {time.time() - t0:.1f} s; free {free_bytes() / GIB:.2f} GiB", flush=True)

stop = False
counts = {"ok": 0, "failed": 0, "tokens": 0}
errors = []


def client(i):
    n = 0
    while not stop:
        body = {"prompt": f"Story {i}.{n}: once upon a time", "max_tokens": 48, "temperature": 0, "stream": True}
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
        try:
            done, toks = False, 0
            with urllib.request.urlopen(req, timeout=300) as r:
                for line in r:
                    line = line.decode().strip()
                    if line == "data: [DONE]":
                        done = True
                        break
                    if line.startswith("data:"):
                        toks += 1
            counts["ok" if done else "failed"] += 1
            counts["tokens"] += toks
        except Exception as e:  # noqa: BLE001 - every failure counts
            counts["failed"] += 1
            errors.append(repr(e))
        n += 1


threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
for t in threads:
    t.start()
time.sleep(STEP_S)
print(f"baseline: {counts}, {metrics(base)}", flush=True)
for target in [40, 12, 3, 1]:
    want = free_bytes() - target * GIB
    rc = take(want) if want > 0 else 0
    time.sleep(STEP_S)
    m = metrics(base)
    print(
        f"hog holds {sum(1 for _ in held)} blocks; asked {want / GIB:.2f} GiB (rc {rc}) to leave {target} GiB free: free now {free_bytes() / GIB:.2f} GiB; "
        f"evictions {m.get('ember_expert_evictions_total', 0):.0f}, misses {m.get('ember_expert_misses_total', 0):.0f}; requests {counts}",
        flush=True,
    )
for p in held:
    cuda.cuMemFree_v2(p)
held.clear()
time.sleep(2 * STEP_S)
m = metrics(base)
print(f"hog gave its memory back: free {free_bytes() / GIB:.2f} GiB; uploads {m.get('ember_expert_uploads_total', 0):.0f}; requests {counts}", flush=True)
stop = True
for t in threads:
    t.join(timeout=120)
proc.terminate()
proc.wait(timeout=60)
tier = [l.rstrip() for l in log if "expert tier" in l or "device" in l]
print("server log (tier and device lines):\n" + "\n".join(tier))
if errors:
    print("errors:", errors[:5])
evicted = m.get("ember_expert_evictions_total", 0)
ok = counts["failed"] == 0 and evicted > 0 and counts["ok"] > 0
print(f"{'ok' if ok else 'FAIL'}: {counts['ok']} requests streamed, {counts['failed']} failed, {evicted:.0f} experts evicted")
sys.exit(0 if ok else 1)
