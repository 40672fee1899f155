#!/usr/bin/env python3
"""`ember serve --device cuda` end to end on the GPU machine (python3 stdlib only).

    python3 bench/gpu/serve-check.py EMBER [serve args...]

Starts the server (default model: the bundled demo model) and checks, printing one line each:
1. continuous batching: 4 requests at once finish, and the engine's steps are fewer than the
   tokens it generated (several sequences per step), from /metrics;
2. streamed output equals non-streamed output (greedy, the same request alone each time),
   for /v1/completions and /v1/chat/completions;
3. the prompt cache: a second chat turn that extends the first restores tokens from the cache
   (ember_prompt_cache_tokens_total grows) and the repeated turn gives the same text;
4. errors: bad JSON is a 400, a prompt longer than the context is a 400, both with a message.
Exits 1 if a check fails.
"""
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

EMBER = sys.argv[1]
ARGS = sys.argv[2:]
failed = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failed.append(name)


def post(base, path, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def stream(base, path, body):
    body = dict(body, stream=True)
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    out, done = [], False
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            out.append(json.loads(payload))
    return out, done


def metrics(base):
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            m[k] = float(v)
    return m


import os
proc = subprocess.Popen([EMBER, "serve", "--port", "0", "--device", os.environ.get("EMBER_DEVICE", "cuda"), *ARGS], stderr=subprocess.PIPE, text=True)
base = None
log = []
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
print(f"server at {base} after {time.time() - t0:.1f} s; its log so far:\n" + "".join(log), flush=True)

try:
    # 1. Continuous batching.
    prompts = ["Once upon a time", "The capital of France is", "def fib(n):", "In 1492, Columbus"]
    before = metrics(base)
    results = [None] * len(prompts)

    def one(i):
        results[i] = post(base, "/v1/completions", {"prompt": prompts[i], "max_tokens": 48, "temperature": 0})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t = time.time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.time() - t
    after = metrics(base)
    steps = after["ember_engine_steps_total"] - before["ember_engine_steps_total"]
    gen = after["ember_engine_generated_tokens_total"] - before["ember_engine_generated_tokens_total"]
    ok = all(r is not None and r[0] == 200 for r in results)
    check("4 concurrent completions", ok, f"{gen:.0f} tokens in {steps:.0f} engine steps, {wall:.2f} s")
    check("several sequences per step", gen > steps, f"{gen / max(steps, 1):.2f} tokens per step")

    # 2. Streamed = non-streamed, one request at a time.
    for path, body, text_of, delta_of in [
        ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0},
         lambda j: j["choices"][0]["text"], lambda c: c["choices"][0].get("text", "") if c.get("choices") else ""),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about GPUs."}], "max_tokens": 40, "temperature": 0},
         lambda j: (j["choices"][0]["message"].get("reasoning_content") or "") + "|" + (j["choices"][0]["message"].get("content") or ""),
         None),
    ]:
        code, full = post(base, path, body)
        whole = text_of(json.loads(full)) if code == 200 else None
        chunks, done = stream(base, path, body)
        if delta_of is None:  # chat: the reasoning and the answer, each streamed as deltas
            ds = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
            streamed = "".join(d.get("reasoning_content") or "" for d in ds) + "|" + "".join(d.get("content") or "" for d in ds)
        else:
            streamed = "".join(delta_of(c) for c in chunks)
        check(f"{path}: streamed = non-streamed", code == 200 and done and streamed == whole, f"{len(streamed)} chars, {len(chunks)} chunks")

    # 3. The prompt cache across chat turns.
    turn1 = [{"role": "user", "content": "Write a long story about a dragon and a knight. " * 8}]
    code, r1 = post(base, "/v1/chat/completions", {"messages": turn1, "max_tokens": 32, "temperature": 0})
    reply = json.loads(r1)["choices"][0]["message"].get("content") or ""
    m0 = metrics(base)
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now make it shorter."}]
    code2, r2 = post(base, "/v1/chat/completions", {"messages": turn2, "max_tokens": 32, "temperature": 0})
    m1 = metrics(base)
    reused = m1["ember_prompt_cache_tokens_total"] - m0["ember_prompt_cache_tokens_total"]
    prompt_toks = json.loads(r2)["usage"]["prompt_tokens"] if code2 == 200 else 0
    check("second turn restores its prefix from the cache", code == 200 and code2 == 200 and reused > 0, f"{reused:.0f} of {prompt_toks} prompt tokens restored")
    code3, r3 = post(base, "/v1/chat/completions", {"messages": turn2, "max_tokens": 32, "temperature": 0})
    m2 = metrics(base)
    a = json.loads(r2)["choices"][0]["message"].get("content")
    b = json.loads(r3)["choices"][0]["message"].get("content") if code3 == 200 else None
    check("the repeated turn (prompt from the cache) gives the same text", a == b,
          f"{m2['ember_prompt_cache_tokens_total'] - m1['ember_prompt_cache_tokens_total']:.0f} tokens restored")

    # 4. Errors.
    code, body = post(base, "/v1/completions", None, raw=b"{not json")
    check("bad JSON is a 400 with a message", code == 400 and "error" in body, body[:120])
    code, body = post(base, "/v1/completions", {"prompt": "word " * 200000, "max_tokens": 4})
    check("a prompt longer than the context is a 400 with a message", code == 400 and "error" in body, body[:160])
    print("metrics at the end:", {k: v for k, v in metrics(base).items() if "cache" in k or "steps" in k or "kv_pages" in k}, flush=True)
finally:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    print("server log tail:\n" + "".join(log[-15:]))

sys.exit(1 if failed else 0)
