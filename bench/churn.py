#!/usr/bin/env python3
"""Churn simulation: does the store stay the size of what is kept?

    cargo build --release --bins && python3 bench/churn.py [--workspaces 8] [--rounds 16]
        [--files 300] [--keep-last 3] [--compact-every 4] [--json out.json]

Starts a release cairn-coordinator (its own data dir, ephemeral ports,
--url-ttl 1s --gc-grace 2s, no collection of its own: the simulation asks
for it) and runs --rounds rounds. In each round every workspace takes one
agent turn (a tenth of its files rewritten with new content, one note file
added that lives on) and a checkpoint (`cairn-runner checkpoint`), then
`cairnctl gc` runs once the grace has passed, and every --compact-every
rounds `cairnctl compact --threshold T` (default 0.7) runs on each
workspace, as an operator's schedule would. Retention: keep-last --keep-last per workspace.

Per round it records the store (bytes of every object under the blob
store's packs/) against the live set (what the kept checkpoints need:
their meta packs plus the live blobs of their data packs, from `cairnctl
compact --dry-run`), the wall time of the collection and of compaction,
and the coordinator's resident memory (VmRSS, and VmHWM at the end).
At the end it times checkpoints of one workspace with collection cycles
running back to back beside them, against the same checkpoints alone
(median ratio), in the same run.

Target (issue 31): store ≤ 1.5× the live set at steady state (the mean of
the last quarter of the rounds).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE_S = 2.0


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Coordinator:
    def __init__(self, binary, data_dir):
        self.data_dir = data_dir
        self.log = open(data_dir + ".log", "wb")
        self.proc = subprocess.Popen(
            [binary, "serve", "--data-dir", data_dir, "--listen", "127.0.0.1:0",
             "--blob-listen", "127.0.0.1:0", "--url-ttl", "1s", "--gc-grace", f"{GRACE_S:g}s",
             "--gc-interval", "0"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"cairn-coordinator exited; see {data_dir}.log")
            try:
                with open(os.path.join(data_dir, "endpoints.json")) as f:
                    self.grpc = json.load(f)["grpc"]
                with open(os.path.join(data_dir, "admin.token")) as f:
                    self.token = f.read().strip()
                if self.token:
                    break
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                pass
            if time.monotonic() > deadline:
                sys.exit("cairn-coordinator did not become ready")
            time.sleep(0.02)

    def memory_kib(self):
        fields = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0])
        return fields

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Sim:
    def __init__(self, args, bins, work):
        self.args, self.bins, self.work = args, bins, work
        self.coordinator = Coordinator(bins["cairn-coordinator"], os.path.join(work, "data"))
        self.env = dict(os.environ, CAIRN_COORDINATOR=self.coordinator.grpc,
                        CAIRN_TOKEN=self.coordinator.token)
        self.env.pop("CAIRN_FAILPOINTS", None)
        self.rng = random.Random(31)

    def run(self, cmd, cache=None):
        env = dict(self.env, CAIRN_CACHE_DIR=cache or os.path.join(self.work, "cache"))
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
        return out.stdout

    def ctl(self, *args):
        return json.loads(self.run([self.bins["cairnctl"], "--output", "json", *args]))

    def root(self, ws):
        return os.path.join(self.work, "ws", ws)

    def make(self, ws):
        root = self.root(ws)
        os.makedirs(os.path.join(root, "src"))
        os.makedirs(os.path.join(root, "notes"))
        for i in range(self.args.files):
            self.write_file(os.path.join(root, "src", f"f{i:04}.txt"))
        self.ctl("workspace", "create", "--name", ws)
        self.ctl("workspace", "retention", ws, "--keep-last", str(self.args.keep_last))

    def write_file(self, path):
        words = [f"{self.rng.getrandbits(48):012x}" for _ in range(self.rng.randint(150, 450))]
        with open(path, "w") as f:
            f.write(" ".join(words))

    def turn(self, ws, n):
        root = self.root(ws)
        for i in self.rng.sample(range(self.args.files), max(1, self.args.files // 10)):
            self.write_file(os.path.join(root, "src", f"f{i:04}.txt"))
        with open(os.path.join(root, "notes", f"turn{n:03}.md"), "w") as f:
            f.write(f"what turn {n} of {ws} learned\n" * 20)

    def checkpoint(self, ws):
        started = time.monotonic()
        self.run([self.bins["cairn-runner"], "checkpoint", "--root", self.root(ws),
                  "--workspace", ws, "--output", "json"],
                 cache=os.path.join(self.work, "cache", ws))
        return time.monotonic() - started

    def store_bytes(self):
        total = 0
        for dirpath, _, files in os.walk(os.path.join(self.coordinator.data_dir, "blobs", "packs")):
            for name in files:
                total += os.path.getsize(os.path.join(dirpath, name))
        return total

    def live_bytes(self, ws):
        shown = self.ctl("workspace", "show", ws)
        dry = self.ctl("compact", ws, "--dry-run")
        referenced = shown["storage"]["referenced_bytes"]
        return referenced - dry["data_bytes"] + dry["live_bytes"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workspaces", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--files", type=int, default=300, help="files per workspace (1-3 KiB of text each)")
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--compact-every", type=int, default=4, help="rounds between compactions (0: never)")
    ap.add_argument("--threshold", type=float, default=0.7,
                    help="cairnctl compact --threshold: rewrite packs less live than this (default 0.7)")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"))
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    bins = {n: os.path.join(args.bin_dir, n) for n in ["cairn-coordinator", "cairn-runner", "cairnctl"]}
    missing = [p for p in bins.values() if not os.access(p, os.X_OK)]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: run `cargo build --release --bins` first")

    work = tempfile.mkdtemp(prefix="cairn-churn-")
    sim = Sim(args, bins, work)
    rows = []
    try:
        names = [f"ws{i:02}" for i in range(args.workspaces)]
        for ws in names:
            sim.make(ws)
        last_gc = 0.0
        for rnd in range(1, args.rounds + 1):
            checkpoint_s = []
            for ws in names:
                sim.turn(ws, rnd)
                checkpoint_s.append(sim.checkpoint(ws))
            compact_s = None
            if args.compact_every and rnd % args.compact_every == 0:
                started = time.monotonic()
                for ws in names:
                    sim.ctl("compact", ws, "--threshold", str(args.threshold))
                compact_s = time.monotonic() - started
            wait = GRACE_S + 0.2 - (time.monotonic() - last_gc)
            if wait > 0:
                time.sleep(wait)
            started = time.monotonic()
            report = sim.ctl("gc")
            gc_s = time.monotonic() - started
            last_gc = time.monotonic()
            store = sim.store_bytes()
            live = sum(sim.live_bytes(ws) for ws in names)
            memory = sim.coordinator.memory_kib()
            row = {
                "round": rnd, "store_bytes": store, "live_bytes": live,
                "ratio": store / live if live else None, "gc_s": gc_s, "compact_s": compact_s,
                "checkpoint_median_s": statistics.median(checkpoint_s),
                "packs_swept": report["packs_swept"] + report["orphans_swept"],
                "rss_kib": memory.get("VmRSS"),
            }
            rows.append(row)
            log(f"round {rnd:2}: store {store / 1024:8.0f} KiB, live {live / 1024:8.0f} KiB, "
                f"{row['ratio']:.2f}x; gc {gc_s * 1000:.0f} ms"
                + (f"; compact {compact_s:.2f} s" if compact_s is not None else ""))

        # A checkpoint's cost with collection cycles running beside it.
        ws = names[0]
        stop = threading.Event()

        def collect():
            while not stop.is_set():
                sim.ctl("gc")

        alone, beside = [], []
        for i in range(6):
            sim.turn(ws, 1000 + i)
            if i % 2 == 0:
                alone.append(sim.checkpoint(ws))
            else:
                thread = threading.Thread(target=collect)
                thread.start()
                time.sleep(0.05)
                beside.append(sim.checkpoint(ws))
                stop.set()
                thread.join()
                stop.clear()
        memory = sim.coordinator.memory_kib()
    finally:
        sim.coordinator.stop()

    steady = rows[-max(1, len(rows) // 4):]
    steady_ratio = statistics.mean(r["ratio"] for r in steady)
    summary = {
        "workspaces": args.workspaces, "rounds": args.rounds, "files": args.files,
        "keep_last": args.keep_last, "compact_every": args.compact_every,
        "threshold": args.threshold,
        "steady_store_over_live": steady_ratio,
        "gc_median_s": statistics.median(r["gc_s"] for r in rows),
        "gc_max_s": max(r["gc_s"] for r in rows),
        "coordinator_peak_rss_kib": memory.get("VmHWM"),
        "checkpoint_alone_median_s": statistics.median(alone),
        "checkpoint_beside_gc_median_s": statistics.median(beside),
        "rounds_detail": rows,
    }
    summary["checkpoint_beside_gc_ratio"] = (
        summary["checkpoint_beside_gc_median_s"] / summary["checkpoint_alone_median_s"])
    print(f"| measure | value |\n|---|---|")
    print(f"| store / live set, steady state (last {len(steady)} rounds) | {steady_ratio:.2f}× (target ≤ 1.5×) |")
    print(f"| gc cycle wall, median / max | {summary['gc_median_s'] * 1000:.0f} ms / {summary['gc_max_s'] * 1000:.0f} ms |")
    print(f"| coordinator peak RSS | {(memory.get('VmHWM') or 0) / 1024:.1f} MiB |")
    print(f"| checkpoint beside gc / alone (median) | {summary['checkpoint_beside_gc_ratio']:.2f}× "
          f"({summary['checkpoint_beside_gc_median_s'] * 1000:.0f} / {summary['checkpoint_alone_median_s'] * 1000:.0f} ms) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()
