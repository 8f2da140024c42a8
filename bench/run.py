#!/usr/bin/env python3
"""Benchmark cairn against the peers' ways of checkpointing a workspace.

    cargo build --release --bins && python3 bench/run.py [--files N --ignored N] [--repeat 3] [--json out.json]
        [--large-files N --large-ignored N --large-repeat N | --no-large] [--only resume | --no-resume]

Builds a workspace with ../shared/bench/make_workspace.py, then measures in
one run, side by side, for each method:

  full         checkpoint of the whole workspace into an empty store
  incremental  checkpoint after one simulated agent turn (make_workspace.py --turn)
  unchanged    cairn only: right after the incremental one, the watcher still
               running, `cairn-runner checkpoint --if-changed`, which cuts no
               checkpoint when the workspace equals its newest one (it prints
               {"unchanged_since": ID, "duration_ms": N}); the peers have no
               such check (n/a)
  restore      the incremental checkpoint into an empty directory; below its
               rows, the write floor: the same files written from memory by
               cairn-write-floor (bench/write-floor: create, write, set the
               mtime, close, on 8 threads, as many as a restore writes
               with; fewer were slower here), nothing downloaded,
               decompressed or checked, which no restore on this
               filesystem can beat; the restore target's note gives cairn's
               and tar-gz's restores as multiples of it
  restore-baked
               the same onto a baked older copy: the target is first filled
               with `cp -a` of the workspace as it was before the agent turn
               (cairn with a fresh runner cache; tar-gz untars over it; restic
               restores over it; neither of those removes stale entries).
               `cp -a` keeps mtimes, so cairn keeps every file whose size and
               mtime are the checkpoint's without reading it
  restore-baked-verify
               cairn only: the same with --verify-existing, which reads and
               hashes every file of the copy: the cost for a copy whose mtimes
               differ (an image that ran `git clone`); the peers: n/a
  restore-cold-cache, restore-warm-cache
               cairn only: two restores into empty directories sharing one
               host pack cache (--pack-cache), each with a fresh runner cache,
               as two sandboxes of one host; the peers have no such cache.
               The store is reached over a --store-mib-s link (default 100
               MiB/s; bench/store_link.py, a pacing HTTP proxy the runner
               uses through HTTP_PROXY): a host cache saves downloads, which
               cost nothing on loopback. The same pair on loopback is shown
               as restore-cold-cache-loopback, restore-warm-cache-loopback
  restore-kept cairn only: the second sandbox of the same workspace on the
               host, as cairn-host starts it: the tree and runner cache the
               first sandbox (restore-cold-cache) left are moved into the new
               sandbox (two renames, timed), and the runner restores onto
               them with the warm pack cache, keeping every file its
               fingerprint cache vouches for; over the same link (and
               restore-kept-loopback on loopback)
  full-4x, incremental-4x
               after the repeats above, on a second workspace with 4x the
               files (--large-files 80000 --large-ignored 120000, 4x
               make_workspace.py's defaults, the same --transcript-mb;
               --no-large skips it): the full checkpoint (cairn, tar-gz,
               restic), then one agent turn and the incremental one (cairn
               through a resident watcher, restic; tar-gz would archive it all
               again: n/a; parts n/a), --large-repeat times (default
               --repeat). The 4x workspace (~1.3 GB) and each repeat's stores
               are removed at the end, unless --keep
  resume       after the repeats of the rows above (before the 4x workspace;
               --only resume runs nothing else, --no-resume skips it), once
               per --repeat: a suspended run answered on another host,
               through real hosts. A release coordinator (its default
               --heartbeat-interval 1s and --host-lease 10s: the critical path
               as shipped), two `cairn-host --driver local --slots 1`
               processes (A and B, fresh data dirs under the repeat's
               directory, kept trees on as by default) and a workspace
               holding the benchmark workspace (`cairn-runner checkpoint` of
               it). One run on it, harness `claude` played by
               cairn-demo-agent (binary=), hold 2 s, every message `ask …`:
               each turn asks a question, the run waits, its hold expires,
               and the host destroys the sandbox (checkpoint) into
               `suspended`. Legs, the other host cordoned each time: the
               run's first attempt on A (not a resume); answer, resume on B,
               which never had the workspace (cold); answer, resume on A,
               which keeps the tree of the first attempt (warm); answer,
               resume on B, which keeps the tree of the cold one (warm). So
               per repeat 1 cold and 2 warm resumes (the script checks
               DATA_DIR/kept/<workspace> before each answer, and the
               restore's reused files after) and 4 suspends. Phases come
               from the run's events (`cairnctl runs events --follow -o
               json`, coordinator clock, millisecond times), from the
               `answered` event (the AnswerRun's commit) on: answered ->
               assigned -> claimed -> restored -> harness_started; the
               runner's own restore duration is the "in N ms" of the
               `restored` event's detail (the restore report). Suspend:
               from the `hold_expired` event (the scheduler acting on the
               run's hold_until; hold_until = the `waiting` event + the hold,
               shown too) to the first event in state `suspended` (the
               sandbox gone, `sandbox_released`), split by the destroy
               checkpoint's event and the runner's `interrupted` (it stopped
               on the destroy order). Resumes also show restored -> the last
               `prepared` event (the fast-forward of app/, whose origin is
               make_workspace.py's bare repository). Tables: per phase, cold
               and warm, min / median / max in ms; the suspend phases likewise

Nothing the run made is deleted before it ends: trees it is done with
(restore targets, each repeat's stores) are set aside by a rename and deleted
together at the end. On ext4 without a journal (these machines), the inode
allocator skips inodes freed in the last minutes, scanning past every one of
them for each new file, so a restore made right after deleting the previous
restore's 50k files spent most of its wall in the kernel (tar-gz restores
varied from 4.7 s to 20 s in one run); which method paid for it depended on
the order of the steps.

Methods: cairn (release cairn-coordinator on ephemeral ports, cairn-runner
checkpoint / restore with a fresh runner cache for the restore, as on a new
host; the incremental checkpoint is asked of a resident `cairn-runner watch`
started after the full one, as the runner inside a sandbox is resident and
tracks changes with inotify), and from ../shared/bench/baselines.sh: tar-gz (restored with untar-gz),
parts (no restore: n/a) and restic (restored with `restic restore latest
--target`). Page caches cannot be dropped here, so every measurement runs
--repeat times (each repeat on a fresh store, one more agent turn into the
workspace; dirty pages are flushed before every timed step) and the table
shows min / median / max wall time. Bytes are what
each method wrote to its store: cairn's uploaded_bytes (from the runner's JSON)
and the growth of the coordinator's blob directory, the archive sizes of
tar-gz and parts, the growth of restic's repository. cairn's notes also show
the checkpoint's upload wait (stats.upload_wait_ms: what waiting for uploads
added to its wall) and, for full checkpoints, the runner's peak resident
memory (ru_maxrss of the child, from os.wait4).

Targets from issue 2, checked on medians (bytes on the worst repeat); the exit
status is 1 when a target is missed:
  full checkpoint         cairn wall <= 0.5 x tar-gz wall
  incremental checkpoint  cairn wall <= 0.1 x restic incremental wall, and <= 300 KB uploaded
  restore                 cairn wall <= 0.5 x tar-gz restore wall
and from issue 5:
  restore onto baked copy cairn restore-baked wall <= 0.2 x cairn restore wall
  warm host cache         cairn restore-kept wall <= 0.3 x restore-cold-cache wall (the
                          note gives restore-warm-cache's ratio too: a second
                          sandbox of the host that finds no kept tree)
  unchanged workspace     cairn unchanged wall <= 20 ms, and nothing uploaded (blob dir
                          growth 0 and unchanged_since reported, every repeat)
  incremental excluding upload
                          median of (cairn incremental wall - upload_wait_ms) <= 100 ms
                          (SKIP when the runner does not report upload_wait_ms)
  peak runner memory      full checkpoint's ru_maxrss <= 200 MiB (worst repeat)
  4x workspace            cairn incremental-4x excluding upload < 2 x the same on the
                          default workspace, turn for turn (repeat k is agent turn k on
                          both; the worst matched turn counts; the note gives the
                          medians too, and restic's incremental 4x/1x ratio: restic
                          grows with the tree), and <= 300 KB uploaded (worst repeat)
and from issue 34 (the resume row; medians over every resume of every repeat):
  warm resume             answered -> harness_started on a host keeping the tree <= 0.3 s
  cold resume             median over cold resumes of (answered -> harness_started minus
                          the runner's own restore duration) <= 0.15 s, i.e. the resume
                          costs at most the restore alone + 0.15 s
  answer -> claimed       answered -> claimed <= 50 ms, cold and warm (a row each)
  suspend                 hold_expired -> suspended <= 0.3 s on an unchanged workspace
                          (the note gives hold_until -> suspended too)
"""
import argparse
import datetime
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from store_link import StoreLink

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_BENCH = os.path.normpath(os.path.join(REPO, "..", "shared", "bench"))
MAKE_WORKSPACE = os.path.join(SHARED_BENCH, "make_workspace.py")
BASELINES = os.path.join(SHARED_BENCH, "baselines.sh")
INCREMENTAL_BYTES_TARGET = 300_000
UNCHANGED_WALL_TARGET_S = 0.020
INCREMENTAL_EXCLUDING_UPLOAD_TARGET_S = 0.100
FULL_PEAK_RSS_TARGET = 200 << 20
LARGE_INCREMENTAL_FACTOR = 2.0
# A sandbox host's share of a regional object store: about a gigabit.
STORE_LINK_MIB_S = 100
RACY_GUARD_S = 3.1
# make_workspace.py's defaults are 20000 tracked and 30000 ignored files.
LARGE_FILES, LARGE_IGNORED = 80_000, 120_000
# Issue 34: the resume row's targets, the run's hold, and the bound of every wait in it.
WARM_RESUME_TARGET_S = 0.300
COLD_RESUME_OVER_RESTORE_TARGET_S = 0.150
ANSWER_TO_CLAIMED_TARGET_S = 0.050
SUSPEND_TARGET_S = 0.300
RESUME_HOLD_S = 2
RESUME_WAIT_S = 180
# (phase, from event, to event) of a resume, by the events' reasons.
RESUME_PHASES = [
    ("answer → assigned", "answered", "assigned"),
    ("assigned → claimed", "assigned", "claimed"),
    ("claimed → restored", "claimed", "restored"),
    ("restored → harness started", "restored", "harness_started"),
    ("answer → claimed", "answered", "claimed"),
    ("answer → harness started", "answered", "harness_started"),
]
# The legs of one resume repeat: (host the run goes to, kind of resume); the first is the run's start.
RESUME_LEGS = [("a", None), ("b", "cold"), ("a", "warm"), ("b", "warm")]

METHODS = ["cairn", "tar-gz", "parts", "restic"]
STEPS = ["full", "incremental", "unchanged", "restore"]
RESTORE_SPEED_STEPS = ["restore-baked", "restore-baked-verify", "restore-cold-cache", "restore-warm-cache",
                       "restore-kept", "restore-cold-cache-loopback", "restore-warm-cache-loopback",
                       "restore-kept-loopback"]
STEPS += RESTORE_SPEED_STEPS
# Isolation's price: another workspace with the same tree shares nothing;
# a fork of the workspace shares the checkpoint it starts from.
ISOLATION_STEPS = ["second-workspace", "fork-checkpoint"]
STEPS += ISOLATION_STEPS
LARGE_STEPS = ["full-4x", "incremental-4x"]
STEPS += LARGE_STEPS

# Where trees the run is done with wait for its end (main() puts it in the
# work directory; see the module doc: deleting them in between would slow
# down whatever creates files next).
SPENT_DIR = None
_spent = itertools.count(1)


def set_aside(path):
    """Moves path, if it exists, out of the way until the run ends."""
    if os.path.lexists(path):
        os.makedirs(SPENT_DIR, exist_ok=True)
        os.rename(path, os.path.join(SPENT_DIR, str(next(_spent))))


class BenchError(Exception):
    """A step of the benchmark failed; the message says which and why."""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd, env=None, cwd=None):
    """Runs cmd, returns (seconds, stdout); raises BenchError with stderr on failure."""
    seconds, out, _ = run_child(cmd, env=env, cwd=cwd)
    return seconds, out


def run_child(cmd, env=None, cwd=None):
    """Runs cmd like run(), and also returns the child's peak resident memory in KiB
    (ru_maxrss from os.wait4): (seconds, stdout, maxrss_kib)."""
    # Flush what earlier steps left dirty, so that no step pays for another's
    # writeback (the page cache itself cannot be dropped here).
    os.sync()
    # Files rather than pipes: the child is reaped with os.wait4 (for its
    # rusage), so nothing may be left for Popen.communicate to read.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        elapsed = time.monotonic() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        stdout = out.read().decode(errors="replace")
        if proc.returncode != 0:
            err.seek(0)
            stderr = err.read().decode(errors="replace")
            raise BenchError(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{stderr.strip()[-2000:]}")
    return elapsed, stdout, usage.ru_maxrss


def tree_bytes(path):
    """Bytes of all regular files under path (0 when it does not exist)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if not os.path.islink(os.path.join(dirpath, name)):
                total += st.st_size
    return total


def count_entries(path):
    files = dirs = 0
    for _, dirnames, filenames in os.walk(path):
        dirs += len(dirnames)
        files += len(filenames)
    return files, dirs


def human_bytes(n):
    if n is None:
        return "n/a"
    for unit in ["B", "KiB", "MiB", "GiB"]:
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def binaries(profile_dir):
    paths = {name: os.path.join(profile_dir, name)
             for name in ["cairn-coordinator", "cairn-runner", "cairnctl", "cairn-write-floor", "cairn-host",
                          "cairn-demo-agent"]}
    missing = [p for p in paths.values() if not os.access(p, os.X_OK)]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: run `cargo build --release --bins` first")
    return paths


class Coordinator:
    """A release cairn-coordinator on ephemeral ports with its own data dir."""

    def __init__(self, binary, data_dir):
        self.data_dir = data_dir
        self.log_path = data_dir + ".log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "serve", "--data-dir", data_dir, "--listen", "127.0.0.1:0", "--blob-listen", "127.0.0.1:0"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        endpoints = os.path.join(data_dir, "endpoints.json")
        token = os.path.join(data_dir, "admin.token")
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"cairn-coordinator exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with open(endpoints) as f:
                    self.grpc = json.load(f)["grpc"]
                with open(token) as f:
                    self.token = f.read().strip()
                if self.token:
                    break
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"cairn-coordinator did not become ready; see {self.log_path}")
            time.sleep(0.02)
        self.blobs_dir = os.path.join(data_dir, "blobs")

    def env(self, cache_dir):
        env = dict(os.environ)
        env.update(CAIRN_COORDINATOR=self.grpc, CAIRN_TOKEN=self.token, CAIRN_CACHE_DIR=cache_dir)
        env.pop("CAIRN_FAILPOINTS", None)
        return env

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Results:
    def __init__(self, steps):
        self.steps = steps
        self.data = {step: {m: {"wall_s": [], "bytes": [], "detail": []} for m in METHODS} for step in steps}
        self.not_applicable = {}
        # cairn-write-floor's write of the restored tree, per repeat: {"wall_s", "threads"}.
        self.write_floor = {"wall_s": [], "threads": []}

    def add(self, step, method, seconds, stored=None, **detail):
        cell = self.data[step][method]
        cell["wall_s"].append(round(seconds, 4))
        cell["bytes"].append(stored)
        cell["detail"].append(detail)

    def na(self, step, method, why):
        self.not_applicable[(step, method)] = why

    def median(self, step, method):
        if step not in self.data:
            return None
        walls = self.data[step][method]["wall_s"]
        return statistics.median(walls) if walls else None

    def worst_bytes(self, step, method):
        if step not in self.data:
            return None
        values = [b for b in self.data[step][method]["bytes"] if b is not None]
        return max(values) if values else None

    def details(self, step, method, key):
        """The detail key of every repeat (None where a repeat lacks it)."""
        if step not in self.data:
            return []
        return [d.get(key) for d in self.data[step][method]["detail"]]


def cairn_checkpoint(bins, coordinator, root, workspace, cache_dir, socket=None, if_changed=False):
    """`cairn-runner checkpoint`: (seconds, JSON report, the runner's peak RSS in KiB).
    Through socket the resident watcher does the work, so the peak RSS is then the client's."""
    via = ["--socket", socket] if socket else []
    if if_changed:
        via.append("--if-changed")
    seconds, out, maxrss_kib = run_child([bins["cairn-runner"], "checkpoint", "--root", root, "--workspace",
                                          workspace, "--output", "json"] + via, env=coordinator.env(cache_dir))
    report = json.loads(out)
    return seconds, report, maxrss_kib


class Watcher:
    """`cairn-runner watch`: the resident runner of a sandbox, which tracks changes with inotify."""

    def __init__(self, bins, coordinator, root, workspace, cache_dir, socket, log_path):
        self.socket = socket
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [bins["cairn-runner"], "watch", "--root", root, "--workspace", workspace, "--socket", socket,
             "--interval", "24h"],
            env=coordinator.env(cache_dir), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not os.path.exists(socket):
            if self.proc.poll() is not None:
                raise BenchError(f"cairn-runner watch exited ({self.proc.returncode}); see {log_path}")
            if time.monotonic() > deadline:
                raise BenchError(f"cairn-runner watch did not listen within 120 s; see {log_path}")
            time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.log.close()


def one_repeat(index, args, bins, work, workspace_root, results, have_restic):
    turn = index + 1
    rep = os.path.join(work, f"repeat-{turn}")
    os.makedirs(rep)
    log(f"repeat {turn}/{args.repeat}: full checkpoints")

    # cairn: a fresh store and cache per repeat, so "full" really uploads everything.
    coordinator = Coordinator(bins["cairn-coordinator"], os.path.join(rep, "coordinator"))
    try:
        cache = os.path.join(rep, "runner-cache")
        full_cairn(bins, coordinator, workspace_root, cache, results, "full")
        isolation_rows(bins, coordinator, rep, workspace_root, results)

        tgz_full = os.path.join(rep, "tar-gz-full")
        seconds, _ = run(["bash", BASELINES, "tar-gz", workspace_root, tgz_full])
        results.add("full", "tar-gz", seconds, tree_bytes(tgz_full))
        parts_full = os.path.join(rep, "parts-full")
        seconds, _ = run(["bash", BASELINES, "parts", workspace_root, parts_full])
        results.add("full", "parts", seconds, tree_bytes(parts_full))
        restic_repo = os.path.join(rep, "restic-repo")
        if have_restic:
            restic_backup(workspace_root, restic_repo, results, "full", init=True)

        # In a sandbox the runner is resident and watches the workspace; so here.
        socket = os.path.join(rep, "watch.sock")
        watcher = Watcher(bins, coordinator, workspace_root, "bench", cache, socket, os.path.join(rep, "watch.log"))
        baked = bake_before_turn(workspace_root, rep)
        log(f"repeat {turn}/{args.repeat}: agent turn {turn}, incremental checkpoints")
        run([sys.executable, MAKE_WORKSPACE, workspace_root, "--turn", str(turn)])
        try:
            incremental_cairn(bins, coordinator, workspace_root, cache, socket, results, "incremental")
            # Nothing changed since: the runner should answer without cutting a checkpoint.
            unchanged_cairn(bins, coordinator, workspace_root, cache, socket, results)
        finally:
            watcher.stop()
        tgz_incr = os.path.join(rep, "tar-gz-incremental")
        seconds, _ = run(["bash", BASELINES, "tar-gz", workspace_root, tgz_incr])
        results.add("incremental", "tar-gz", seconds, tree_bytes(tgz_incr))
        parts_incr = os.path.join(rep, "parts-incremental")
        seconds, _ = run(["bash", BASELINES, "parts", workspace_root, parts_incr])
        results.add("incremental", "parts", seconds, tree_bytes(parts_incr))
        if have_restic:
            restic_backup(workspace_root, restic_repo, results, "incremental")

        log(f"repeat {turn}/{args.repeat}: restores into empty directories")
        expected_files, _ = count_entries(workspace_root)
        target = os.path.join(rep, "restore-cairn")
        fresh_cache = os.path.join(rep, "restore-cache")
        seconds, out = run([bins["cairn-runner"], "restore", "--root", target, "--workspace", "bench",
                            "--output", "json"], env=coordinator.env(fresh_cache))
        restored = json.loads(out)
        check_restored("cairn", target, expected_files)
        results.add("restore", "cairn", seconds, None, bytes_downloaded=restored.get("bytes_downloaded"))
        set_aside(target)

        target = os.path.join(rep, "restore-tar-gz")
        seconds, _ = run(["bash", BASELINES, "untar-gz", os.path.join(tgz_incr, "workspace.tgz"), target])
        check_restored("tar-gz", target, expected_files)
        results.add("restore", "tar-gz", seconds, None, bytes_downloaded=tree_bytes(tgz_incr))
        set_aside(target)
        results.na("restore", "parts", "parts has no restore")

        if have_restic:
            target = os.path.join(rep, "restore-restic")
            seconds, _ = run(["restic", "restore", "latest", "--quiet", "--repo", restic_repo, "--target", target],
                             env=dict(os.environ, RESTIC_PASSWORD="bench"))
            # restic recreates the absolute source path under the target.
            check_restored("restic", os.path.join(target, workspace_root.lstrip("/")), expected_files)
            results.add("restore", "restic", seconds, None)
            set_aside(target)

        target = os.path.join(rep, "write-floor")
        _, out = run([bins["cairn-write-floor"], "--from", workspace_root, "--to", target])
        floor = json.loads(out)
        check_restored("cairn-write-floor", target, expected_files)
        results.write_floor["wall_s"].append(round(floor["seconds"], 4))
        results.write_floor["threads"].append(floor["threads"])
        set_aside(target)

        restore_speed_rows(bins, coordinator, rep, workspace_root, baked, tgz_incr, restic_repo, results,
                           have_restic, expected_files, args.store_mib_s << 20)
    finally:
        coordinator.stop()
    if not args.keep:
        set_aside(rep)


def isolation_rows(bins, coordinator, rep, root, results):
    """What workspace isolation costs: a second workspace checkpointing the same tree (a fresh machine:
    empty runner cache) deduplicates against nothing of the first; a fork of the first checkpointing the
    same tree deduplicates against the checkpoint it was forked from."""
    env = coordinator.env(os.path.join(rep, "ctl-cache"))
    run([bins["cairnctl"], "--output", "json", "workspace", "create", "--name", "bench-second"], env=env)
    for step, workspace in (("second-workspace", "bench-second"), ("fork-checkpoint", "bench-fork-1")):
        if step == "fork-checkpoint":
            run([bins["cairnctl"], "--output", "json", "workspace", "fork", "bench", "--count", "1",
                 "--name-prefix", "bench-fork"], env=env)
        before = tree_bytes(coordinator.blobs_dir)
        seconds, report, _ = cairn_checkpoint(bins, coordinator, root, workspace,
                                              os.path.join(rep, f"cache-{step}"))
        grown = tree_bytes(coordinator.blobs_dir) - before
        stats = report["stats"]
        results.add(step, "cairn", seconds, stats["uploaded_bytes"], store_growth=grown,
                    files_read=stats["files_read"])
        for method in METHODS[1:]:
            results.na(step, method, "one archive per copy: no workspaces to share between")


def restic_backup(root, restic_repo, results, step, init=False):
    """restic's checkpoint of root into restic_repo (made first with init): wall and repository growth."""
    if init:
        run(["restic", "init", "--quiet", "--repo", restic_repo], env=dict(os.environ, RESTIC_PASSWORD="bench"))
    before = tree_bytes(restic_repo)
    seconds, _ = run(["bash", BASELINES, "restic", root, restic_repo])
    results.add(step, "restic", seconds, tree_bytes(restic_repo) - before)


def full_cairn(bins, coordinator, root, cache, results, step):
    """cairn's full checkpoint of root into the coordinator's empty store, with the runner's peak RSS."""
    run([bins["cairnctl"], "--output", "json", "workspace", "create", "--name", "bench"],
        env=coordinator.env(cache))
    before = tree_bytes(coordinator.blobs_dir)
    seconds, report, maxrss_kib = cairn_checkpoint(bins, coordinator, root, "bench", cache)
    grown = tree_bytes(coordinator.blobs_dir) - before
    stats = report["stats"]
    results.add(step, "cairn", seconds, stats["uploaded_bytes"], store_growth=grown,
                files=stats["files"], total_bytes=stats["total_bytes"], maxrss_kib=maxrss_kib)


def incremental_cairn(bins, coordinator, workspace_root, cache, socket, results, step):
    """cairn's incremental checkpoint, asked of the resident watcher through its socket."""
    before = tree_bytes(coordinator.blobs_dir)
    seconds, report, _ = cairn_checkpoint(bins, coordinator, workspace_root, "bench", cache, socket)
    grown = tree_bytes(coordinator.blobs_dir) - before
    stats = report["stats"]
    results.add(step, "cairn", seconds, stats["uploaded_bytes"], store_growth=grown,
                files_read=stats["files_read"], upload_wait_ms=stats.get("upload_wait_ms"))


def unchanged_cairn(bins, coordinator, workspace_root, cache, socket, results):
    """Issue 5: `checkpoint --if-changed` right after a checkpoint, the watcher still running."""
    before = tree_bytes(coordinator.blobs_dir)
    seconds, report, _ = cairn_checkpoint(bins, coordinator, workspace_root, "bench", cache, socket,
                                          if_changed=True)
    grown = tree_bytes(coordinator.blobs_dir) - before
    since = report.get("unchanged_since")
    if since is not None:
        note = f"unchanged since {since}; runner {report.get('duration_ms')} ms"
        uploaded = 0
    else:
        note = "cut a new checkpoint: the runner saw a change"
        uploaded = report.get("stats", {}).get("uploaded_bytes")
    results.add("unchanged", "cairn", seconds, uploaded, store_growth=grown, unchanged_since=since, note=note)


def one_large_repeat(index, args, bins, work, large_root, results, have_restic):
    """Issue 5: full and incremental checkpoints of the 4x workspace (cairn, tar-gz full, restic)."""
    turn = index + 1
    rep = os.path.join(work, f"large-repeat-{turn}")
    os.makedirs(rep)
    log(f"4x workspace, repeat {turn}/{args.large_repeat}: full checkpoints")
    coordinator = Coordinator(bins["cairn-coordinator"], os.path.join(rep, "coordinator"))
    try:
        cache = os.path.join(rep, "runner-cache")
        full_cairn(bins, coordinator, large_root, cache, results, "full-4x")
        tgz_full = os.path.join(rep, "tar-gz-full")
        seconds, _ = run(["bash", BASELINES, "tar-gz", large_root, tgz_full])
        results.add("full-4x", "tar-gz", seconds, tree_bytes(tgz_full))
        set_aside(tgz_full)
        restic_repo = os.path.join(rep, "restic-repo")
        if have_restic:
            restic_backup(large_root, restic_repo, results, "full-4x", init=True)

        socket = os.path.join(rep, "watch.sock")
        watcher = Watcher(bins, coordinator, large_root, "bench", cache, socket, os.path.join(rep, "watch.log"))
        log(f"4x workspace, repeat {turn}/{args.large_repeat}: agent turn {turn}, incremental checkpoints")
        try:
            run([sys.executable, MAKE_WORKSPACE, large_root, "--turn", str(turn)])
            incremental_cairn(bins, coordinator, large_root, cache, socket, results, "incremental-4x")
        finally:
            watcher.stop()
        if have_restic:
            restic_backup(large_root, restic_repo, results, "incremental-4x")
    finally:
        coordinator.stop()
    if not args.keep:
        set_aside(rep)


# ---------------------------------------------------------------------------
# resume (issue 34): a suspended run answered on another host, through real hosts.

def ctl(bins, coordinator, cache, *args):
    """`cairnctl -o json ARGS`: the parsed document (None when it printed nothing). No sync first,
    unlike run(): this is for calls made while waiting."""
    try:
        proc = subprocess.run([bins["cairnctl"], "--output", "json", *args], env=coordinator.env(cache),
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise BenchError(f"`cairnctl {' '.join(args)}` did not return within 120 s") from None
    if proc.returncode != 0:
        raise BenchError(f"`cairnctl {' '.join(args)}` exited {proc.returncode}:\n"
                         f"{proc.stderr.decode(errors='replace').strip()[-2000:]}")
    out = proc.stdout.decode(errors="replace").strip()
    return json.loads(out) if out else None


def local_sandboxes_work():
    """Whether cairn-host's local driver can make sandboxes here: root, or unprivileged user
    namespaces (as tests/src/fleet.rs's require_local_sandboxes asks)."""
    if os.geteuid() == 0:
        return True
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def sandbox_pids(sandbox_ids):
    """Processes whose environment names one of sandbox_ids (CAIRN_SANDBOX_ID), as the tests find them."""
    wanted = {f"CAIRN_SANDBOX_ID={i}".encode() for i in sandbox_ids}
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
        except OSError:
            continue
        if env & wanted:
            pids.append(int(entry))
    return pids


class Host:
    """A release `cairn-host --driver local --slots 1` with its own data dir, as the end-to-end
    tests start one (tests/src/fleet.rs): the admin token, the binaries' directory first on the
    sandboxes' PATH, and (with setpriv) killed should this script die."""

    def __init__(self, bins, coordinator, data_dir, name):
        self.name = name
        self.data_dir = data_dir
        self.sandboxes = os.path.join(data_dir, "sandboxes")
        self.log_path = data_dir + ".log"
        os.makedirs(data_dir)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CAIRN_")}
        env["CAIRN_TOKEN"] = coordinator.token
        bin_dir = os.path.dirname(bins["cairn-host"])
        cmd = [bins["cairn-host"], "--coordinator", coordinator.grpc, "--data-dir", data_dir, "--name", name,
               "--slots", "1", "--driver", "local", "--env", f"PATH={bin_dir}:{os.environ.get('PATH', '')}"]
        if os.access("/usr/bin/setpriv", os.X_OK):
            cmd = ["/usr/bin/setpriv", "--pdeathsig", "KILL", "--"] + cmd
        self.log = open(self.log_path, "wb")
        self.seen_sandboxes = set()
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"cairn-host {name} exited ({self.proc.returncode}) before it registered; "
                                 f"see {self.log_path}")
            try:
                with open(os.path.join(data_dir, "host-id")) as f:
                    self.id = f.read().strip()
                if self.id.startswith("host-"):
                    break
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"cairn-host {name} did not register within 60 s; see {self.log_path}")
            time.sleep(0.05)

    def kept(self, workspace_id):
        """Whether the host keeps a tree of the workspace (DATA_DIR/kept/<id>)."""
        return os.path.isdir(os.path.join(self.data_dir, "kept", workspace_id))

    def note_sandboxes(self):
        if os.path.isdir(self.sandboxes):
            self.seen_sandboxes.update(os.listdir(self.sandboxes))

    def tail(self, lines=30):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self):
        """SIGTERM (the host destroys its sandboxes and exits), SIGKILL after 60 s; then any process
        of its sandboxes that outlived it, by pid."""
        self.note_sandboxes()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                log(f"cairn-host {self.name} still ran 60 s after SIGTERM: killing it")
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        left = sandbox_pids(self.seen_sandboxes)
        for pid in left:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        if left:
            log(f"killed {len(left)} process(es) of {self.name}'s sandboxes that outlived it: {left}")


def event_time(at):
    """An event's `at` (RFC 3339, milliseconds, UTC) as seconds since the epoch."""
    return datetime.datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()


class EventFollower:
    """`cairnctl runs events RUN --follow -o json`: the run's events, one JSON object a line, as
    the coordinator commits them (it pushes them; nothing polls), collected by a thread."""

    def __init__(self, bins, coordinator, cache, run_id, log_path):
        self.run_id = run_id
        self.events = []
        self.closed = False
        self.cond = threading.Condition()
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [bins["cairnctl"], "--output", "json", "runs", "events", run_id, "--follow"],
            env=coordinator.env(cache), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            event["t"] = event_time(event["at"])
            with self.cond:
                self.events.append(event)
                self.cond.notify_all()
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def wait_for(self, what, wanted, start=0, timeout=RESUME_WAIT_S):
        """Index of the first event at or after start that wanted() accepts; BenchError when the run
        ends, the stream closes or timeout passes first."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for i in range(start, len(self.events)):
                    event = self.events[i]
                    if wanted(event):
                        return i
                    if event["state"] in ("succeeded", "failed", "cancelled"):
                        raise BenchError(f"run {self.run_id} ended {event['state']} while waiting for {what}:\n"
                                         + self.describe())
                start = max(start, len(self.events))
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    why = "the event stream closed" if self.closed else f"not within {timeout} s"
                    raise BenchError(f"run {self.run_id}: {what}: {why}; its events:\n" + self.describe())
                self.cond.wait(min(left, 1.0))

    def describe(self, last=40):
        return "\n".join(f"  {e['at']} {e['state']:<9} {e['reason']:<17} {e['host_id'] or '-':<22} "
                         f"#{e['attempt']} {e['checkpoint_id'] or '-'} {e['detail'][:160]}"
                         for e in self.events[-last:])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.thread.join(timeout=10)
        self.log.close()


class ResumeResults:
    """The resume row's samples: every resume ({"cold": [...], "warm": [...]}) and every suspend."""

    def __init__(self):
        self.resumes = {"cold": [], "warm": []}
        self.suspends = []

    def values(self, kind, key):
        samples = self.suspends if kind == "suspend" else self.resumes[kind]
        return [s[key] for s in samples if s.get(key) is not None]

    def median(self, kind, key):
        values = self.values(kind, key)
        return statistics.median(values) if values else None


def first_event(events, start, reason, attempt=None):
    for i in range(start, len(events)):
        if events[i]["reason"] == reason and (attempt is None or events[i]["attempt"] == attempt):
            return i
    return None


def resume_sample(events, answered, host, kind, repeat):
    """A resume's phases from its events, answered (index) on: seconds between the events of
    RESUME_PHASES, the runner's restore duration and what the restore kept."""
    assigned = first_event(events, answered, "assigned")
    if assigned is None:
        raise BenchError("no assigned event after the answer")
    attempt = events[assigned]["attempt"]
    if events[assigned]["host_id"] != host.id:
        raise BenchError(f"the answer resumed the run on {events[assigned]['host_id']}, not on {host.name} "
                         f"({host.id}), the only uncordoned host")
    at = {"answered": events[answered]["t"], "assigned": events[assigned]["t"]}
    index = assigned
    for reason in ["claimed", "restored", "harness_started"]:
        found = first_event(events, index, reason, attempt)
        if found is None:
            raise BenchError(f"attempt {attempt}: no {reason} event")
        at[reason] = events[found]["t"]
        if reason == "restored":
            restored = events[found]["detail"]
            restored_at = found
        index = found
    sample = {"repeat": repeat, "kind": kind, "host": host.name, "attempt": attempt}
    for name, start, end in RESUME_PHASES:
        sample[name] = round(at[end] - at[start], 4)
    # Prepare steps between the restore and the harness (the checkouts' fast-forward, services).
    prepared = [e for e in events[restored_at:index] if e["reason"] == "prepared" and e["attempt"] == attempt]
    if prepared:
        sample["restored → last prepared"] = round(prepared[-1]["t"] - at["restored"], 4)
        sample["prepared"] = [e["detail"] for e in prepared]
    took = re.search(r"downloaded [^;]*? in (\d+) ms", restored)
    reused = re.search(r"reused (\d+) files", restored)
    sample["restore_s"] = int(took.group(1)) / 1000 if took else None
    sample["files_reused"] = int(reused.group(1)) if reused else None
    total = sample["answer → harness started"]
    sample["less restore"] = None if took is None else round(total - sample["restore_s"], 4)
    sample["restored_detail"] = restored
    return sample


def suspend_sample(events, waiting, expired, suspended, repeat, host):
    """A suspend's phases: hold_until (the waiting event + the hold) -> hold_expired -> the
    destroy checkpoint's event, if any -> the first event in state suspended."""
    hold_until = events[waiting]["t"] + RESUME_HOLD_S
    t_expired, t_suspended = events[expired]["t"], events[suspended]["t"]
    sample = {"repeat": repeat, "host": host.name, "attempt": events[expired]["attempt"],
              "hold_until → hold_expired": round(t_expired - hold_until, 4),
              "hold_expired → suspended": round(t_suspended - t_expired, 4),
              "hold_until → suspended": round(t_suspended - hold_until, 4),
              "turn checkpoint": events[waiting]["checkpoint_id"] or None}
    checkpoint = first_event(events[:suspended], expired, "checkpoint", events[expired]["attempt"])
    # The runner's own report that it stopped (outcome interrupted), after the checkpoint and its
    # handoff note; the host then reports the sandbox gone.
    stopped = first_event(events[:suspended], expired, "interrupted", events[expired]["attempt"])
    if checkpoint is not None:
        sample["hold_expired → destroy checkpoint"] = round(events[checkpoint]["t"] - t_expired, 4)
        sample["destroy checkpoint → suspended"] = round(t_suspended - events[checkpoint]["t"], 4)
        sample["checkpoint_detail"] = events[checkpoint]["detail"]
        if stopped is not None and stopped > checkpoint:
            sample["destroy checkpoint → runner stopped"] = round(events[stopped]["t"] - events[checkpoint]["t"], 4)
    if stopped is not None:
        sample["runner stopped → suspended"] = round(t_suspended - events[stopped]["t"], 4)
    sample["events"] = [f"{e['reason']}: {e['detail'][:200]}" for e in events[expired:suspended + 1]]
    return sample


def only_host(bins, coordinator, cache, hosts, name):
    """Uncordons host name and cordons every other one: the scheduler can place only there."""
    for other, host in hosts.items():
        ctl(bins, coordinator, cache, "hosts", "uncordon" if other == name else "cordon", host.name)


def wait_hosts_ready(bins, coordinator, cache, hosts):
    deadline = time.monotonic() + 60
    names = {h.name for h in hosts.values()}
    while True:
        listed = {h["name"]: h["state"] for h in ctl(bins, coordinator, cache, "hosts", "list") or []}
        if all(listed.get(n) == "ready" for n in names):
            return
        if time.monotonic() > deadline:
            raise BenchError(f"hosts not ready within 60 s: {listed}")
        time.sleep(0.1)


def resume_repeat(index, args, bins, work, workspace_root, resume):
    """Issue 34: one run on a workspace holding the benchmark workspace, resumed cold on B, warm on A,
    warm on B (RESUME_LEGS), each suspend through its hold's expiry."""
    turn = index + 1
    rep = os.path.join(work, f"resume-{turn}")
    os.makedirs(rep)
    coordinator = Coordinator(bins["cairn-coordinator"], os.path.join(rep, "coordinator"))
    hosts, follower = {}, None
    try:
        cache = os.path.join(rep, "ctl-cache")
        workspace = ctl(bins, coordinator, cache, "workspace", "create", "--name", "resume")["id"]
        log(f"resume, repeat {turn}/{args.repeat}: checkpointing the workspace into {workspace}")
        cairn_checkpoint(bins, coordinator, workspace_root, workspace, os.path.join(rep, "runner-cache"))
        for name in ["a", "b"]:
            hosts[name] = Host(bins, coordinator, os.path.join(rep, f"host-{name}"), f"bench-{name}")
        wait_hosts_ready(bins, coordinator, cache, hosts)
        after = 0
        for number, (name, kind) in enumerate(RESUME_LEGS, start=1):
            host = hosts[name]
            only_host(bins, coordinator, cache, hosts, name)
            question = f"ask Leg {number} of the resume bench: go on?"
            if kind is None:
                log(f"resume, repeat {turn}/{args.repeat}: the run's first attempt on {host.name}")
                run_ = ctl(bins, coordinator, cache, "runs", "create", "--workspace", workspace, "--harness", "claude",
                           "--harness-config", f"binary={bins['cairn-demo-agent']}", "--prompt", question,
                           "--hold", f"{RESUME_HOLD_S}s")
                follower = EventFollower(bins, coordinator, cache, run_["id"], os.path.join(rep, "events.log"))
                start = 0
            else:
                kept = host.kept(workspace)
                if kept != (kind == "warm"):
                    raise BenchError(f"a {kind} resume on {host.name}, which {'keeps' if kept else 'keeps no'} "
                                     f"tree of {workspace}")
                log(f"resume, repeat {turn}/{args.repeat}: answer, {kind} resume on {host.name}")
                os.sync()
                ctl(bins, coordinator, cache, "runs", "answer", follower.run_id, question)
                start = follower.wait_for("the answer", lambda e: e["reason"] == "answered", after)
            started = follower.wait_for("the harness to start", lambda e: e["reason"] == "harness_started", start)
            waiting = follower.wait_for("the question", lambda e: e["reason"] == "waiting", started)
            expired = follower.wait_for("the hold to expire", lambda e: e["reason"] == "hold_expired", waiting)
            suspended = follower.wait_for("the run to be suspended", lambda e: e["state"] == "suspended", expired)
            host.note_sandboxes()
            events = list(follower.events)
            if kind is not None:
                sample = resume_sample(events, start, host, kind, turn)
                if kind == "warm" and not sample["files_reused"]:
                    raise BenchError(f"the warm resume on {host.name} kept no file: {sample['restored_detail']}")
                resume.resumes[kind].append(sample)
                log(f"  {kind} on {host.name}: answer -> harness started {sample['answer → harness started']:.3f} s "
                    f"(restore {sample['restore_s']} s, {sample['files_reused']} files kept)")
            sample = suspend_sample(events, waiting, expired, suspended, turn, host)
            resume.suspends.append(sample)
            log(f"  suspend on {host.name}: hold_expired -> suspended {sample['hold_expired → suspended']:.3f} s")
            after = suspended + 1
    except BenchError as e:
        tails = "".join(f"\n--- {h.log_path} (last lines) ---\n{h.tail()}" for h in hosts.values())
        raise BenchError(f"resume repeat {turn}: {e}{tails}\n(--workdir DIR --keep keeps the hosts' data dirs, "
                         f"sandbox logs and the coordinator's)") from None
    finally:
        if follower:
            follower.stop()
        for host in hosts.values():
            host.stop()
        coordinator.stop()
    if not args.keep:
        set_aside(rep)


def fmt_ms(values):
    if not values:
        return "n/a"
    return f"{min(values) * 1000:.0f} / {statistics.median(values) * 1000:.0f} / {max(values) * 1000:.0f}"


def resume_table(resume):
    cold, warm = len(resume.resumes["cold"]), len(resume.resumes["warm"])
    lines = [f"| resume phase | cold host, ms (min / median / max; {cold} resumes) | "
             f"warm host, kept tree, ms (min / median / max; {warm} resumes) |", "|---|---|---|"]
    rows = [(name, name) for name, _, _ in RESUME_PHASES[:4]] + [
        ("  of which restored → last prepared (fast-forward of app/)", "restored → last prepared")] + [
        (name, name) for name, _, _ in RESUME_PHASES[4:]] + [
        ("runner's restore (the restored event's own duration)", "restore_s"),
        ("answer → harness started less the runner's restore", "less restore")]
    for label, key in rows:
        lines.append(f"| {label} | {fmt_ms(resume.values('cold', key))} | {fmt_ms(resume.values('warm', key))} |")
    kept = [resume.values(kind, "files_reused") for kind in ("cold", "warm")]
    lines.append("| files the restore kept (median) | " + " | ".join(
        f"{statistics.median(v):.0f}" if v else "n/a" for v in kept) + " |")
    lines += ["", f"| suspend phase | ms (min / median / max; {len(resume.suspends)} suspends) |", "|---|---|"]
    for key in ["hold_until → hold_expired", "hold_expired → destroy checkpoint", "destroy checkpoint → suspended",
                "  of which destroy checkpoint → runner stopped", "  of which runner stopped → suspended",
                "hold_expired → suspended", "hold_until → suspended"]:
        lines.append(f"| {key} | {fmt_ms(resume.values('suspend', key.replace('  of which ', '')))} |")
    details = [s["checkpoint_detail"] for s in resume.suspends if s.get("checkpoint_detail")]
    if details:
        lines.append(f"| the destroy checkpoint (last) | {details[-1]} |")
    return "\n".join(lines)


def resume_targets(resume):
    out = []
    value = resume.median("warm", "answer → harness started")
    out.append(seconds_row("warm resume: answer → harness started", WARM_RESUME_TARGET_S, value,
                           "not measured" if value is None else
                           f"median of {len(resume.values('warm', 'answer → harness started'))} warm resumes"))
    value = resume.median("cold", "less restore")
    if value is None:
        note = "not measured"
    else:
        note = (f"median over cold resumes of answer → harness started ({resume.median('cold', 'answer → harness started'):.3f} s "
                f"median) less the runner's restore ({resume.median('cold', 'restore_s'):.3f} s median)")
    out.append(seconds_row("cold resume: time beyond the restore alone", COLD_RESUME_OVER_RESTORE_TARGET_S, value, note))
    for kind in ["cold", "warm"]:
        value = resume.median(kind, "answer → claimed")
        out.append(seconds_row(f"{kind} resume: answer → claimed", ANSWER_TO_CLAIMED_TARGET_S, value,
                               "not measured" if value is None else f"median; assigned → claimed "
                               f"{resume.median(kind, 'assigned → claimed') * 1000:.0f} ms of it"))
    value = resume.median("suspend", "hold_expired → suspended")
    out.append(seconds_row("suspend: hold expiry → suspended (unchanged workspace)", SUSPEND_TARGET_S, value,
                           "not measured" if value is None else
                           f"median of {len(resume.suspends)}, from the hold_expired event; from hold_until "
                           f"{resume.median('suspend', 'hold_until → suspended'):.3f} s"))
    return out


def bake_before_turn(workspace_root, rep):
    """The workspace before the agent turn, as an image would have baked it."""
    baked = os.path.join(rep, "baked")
    run(["cp", "-a", workspace_root, baked])
    return baked


def prefill(baked, target):
    """Fills target (made anew) with a copy of the baked workspace."""
    if os.path.exists(target):
        set_aside(target)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    run(["cp", "-a", baked, target])


def stale_note(target, expected_files):
    files, _ = count_entries(target)
    return f"keeps {files - expected_files} stale files" if files > expected_files else ""


def restore_speed_rows(bins, coordinator, rep, workspace_root, baked, tgz_incr, restic_repo, results,
                       have_restic, expected_files, link_bytes_per_s):
    """Issue 5: restore onto a baked older copy, and a second restore with a warm host cache."""
    log("restores onto a baked older copy")
    for step, extra in [("restore-baked", []), ("restore-baked-verify", ["--verify-existing"])]:
        target = os.path.join(rep, f"{step}-cairn")
        prefill(baked, target)
        seconds, out = run([bins["cairn-runner"], "restore", "--root", target, "--workspace", "bench",
                            "--output", "json", *extra], env=coordinator.env(os.path.join(rep, f"{step}-cache")))
        report = json.loads(out)
        check_restored("cairn", target, expected_files)
        results.add(step, "cairn", seconds, None, bytes_downloaded=report.get("bytes_downloaded"),
                    note=f"{report.get('files_reused')} files reused, {human_bytes(report.get('bytes_written'))} "
                         f"written, {report.get('entries_removed')} stale entries removed")
        set_aside(target)
    for method in ["tar-gz", "parts", "restic"]:
        results.na("restore-baked-verify", method, "no such option: see its restore-baked row")

    target = os.path.join(rep, "baked-tar-gz")
    prefill(baked, target)
    seconds, _ = run(["tar", "-C", target, "-xzf", os.path.join(tgz_incr, "workspace.tgz")])
    results.add("restore-baked", "tar-gz", seconds, None, bytes_downloaded=tree_bytes(tgz_incr),
                note="untars every file over the copy; " + (stale_note(target, expected_files) or "no stale files"))
    set_aside(target)
    results.na("restore-baked", "parts", "parts has no restore")
    if have_restic:
        target = os.path.join(rep, "baked-restic")
        # restic recreates the absolute source path under the target.
        inner = os.path.join(target, workspace_root.lstrip("/"))
        prefill(baked, inner)
        try:
            seconds, _ = run(["restic", "restore", "latest", "--quiet", "--repo", restic_repo, "--target", target],
                             env=dict(os.environ, RESTIC_PASSWORD="bench"))
            results.add("restore-baked", "restic", seconds, None,
                        note="rewrites every file over the copy; " + (stale_note(inner, expected_files) or "no stale files"))
        except BenchError as e:
            # restic 0.14 cannot replace an existing symlink ("file exists") and exits 1.
            last = [line for line in str(e).splitlines() if line.strip()][-2:]
            results.na("restore-baked", "restic", "restic cannot restore over a pre-filled directory: " + " ".join(last)[:200])
        set_aside(target)

    rounds = [("restore-cold-cache", "restore-warm-cache", "restore-kept", link_bytes_per_s)]
    if link_bytes_per_s:
        rounds.append(("restore-cold-cache-loopback", "restore-warm-cache-loopback", "restore-kept-loopback", 0))
    for cold, warm, kept, rate in rounds:
        log("three restores sharing a host pack cache, the last onto the first one's kept tree" +
            (f", the store behind a {human_bytes(rate)}/s link" if rate else ", the store on loopback"))
        cached_restores(bins, coordinator, rep, expected_files, results, (cold, warm, kept), rate)
    for step in [step for round_ in rounds for step in round_[:3]]:
        for method in ["tar-gz", "parts", "restic"]:
            results.na(step, method, "no host-level cache: every restore is a cold one")


def cached_restores(bins, coordinator, rep, expected_files, results, steps, link_bytes_per_s):
    """Three restores sharing a host pack cache: two into empty directories, then one onto the
    tree and runner cache the first left, moved as cairn-host moves a kept tree into the next
    sandbox of its workspace. With a link rate, every signed-URL transfer goes through a
    StoreLink of that bandwidth (HTTP_PROXY)."""
    pack_cache = os.path.join(rep, "host-pack-cache")
    link = StoreLink(link_bytes_per_s) if link_bytes_per_s else None
    cold, warm, kept = steps
    try:
        for step, name in [(cold, "first"), (warm, "second"), (kept, "kept")]:
            target = os.path.join(rep, f"cached-{name}")
            cache_dir = os.path.join(rep, f"cached-{name}-cache")
            env = coordinator.env(cache_dir)
            for var in ["NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"]:
                env.pop(var, None)
            if link:
                env.update(HTTP_PROXY=link.url, http_proxy=link.url)
            relayed_before = link.relayed_bytes if link else 0
            started = time.monotonic()
            if step == kept:
                os.rename(os.path.join(rep, "cached-first"), target)
                os.rename(os.path.join(rep, "cached-first-cache"), cache_dir)
            moved = time.monotonic() - started
            seconds, out = run([bins["cairn-runner"], "restore", "--root", target, "--workspace", "bench",
                                "--pack-cache", pack_cache, "--output", "json"], env=env)
            seconds += moved
            report = json.loads(out)
            check_restored("cairn", target, expected_files)
            note = f"{human_bytes(report.get('bytes_from_cache', 0))} from the host cache"
            if step == kept:
                note = (f"{report.get('files_reused')} files kept, {human_bytes(report.get('bytes_written'))} "
                        f"written; " + note)
            if link:
                relayed = link.relayed_bytes - relayed_before
                if name == "first" and report.get("bytes_downloaded") and not relayed:
                    raise BenchError("the restore's downloads did not go through the store link (HTTP_PROXY)")
                note += f"; {human_bytes(relayed)} over the {human_bytes(link_bytes_per_s)}/s link"
            else:
                note += "; store on loopback"
            results.add(step, "cairn", seconds, None, bytes_downloaded=report.get("bytes_downloaded"), note=note)
            if step != cold:
                set_aside(target)
                set_aside(cache_dir)
    finally:
        if link:
            link.stop()
        set_aside(pack_cache)


def restore_speed_targets(results):
    out = []
    for name, step, baseline_step, limit in [
            ("restore onto a baked copy vs restore into empty", "restore-baked", "restore", 0.2),
            ("second restore with a warm host cache vs the first", "restore-kept", "restore-cold-cache", 0.3)]:
        mine, theirs = results.median(step, "cairn"), results.median(baseline_step, "cairn")
        if mine is None or not theirs:
            out.append({"target": name, "limit": f"<= {limit} x", "value": None, "pass": None,
                        "note": "not measured"})
            continue
        value = mine / theirs
        note = f"cairn {mine:.2f} s vs cairn {baseline_step} {theirs:.2f} s"
        if step == "restore-kept":
            links = [n for n in results.details(step, "cairn", "note") if n and "link" in n]
            if links:
                note += "; the store behind " + links[0].split(" over the ")[-1]
            pack_only = results.median("restore-warm-cache", "cairn")
            if pack_only is not None:
                note += (f"; a sandbox with no kept tree (pack cache only): {pack_only / theirs:.2f} x "
                         f"({pack_only:.2f} s)")
            local = results.median("restore-kept-loopback", "cairn"), \
                results.median("restore-cold-cache-loopback", "cairn")
            if local[0] is not None and local[1]:
                note += f"; on loopback {local[0] / local[1]:.2f} x ({local[0]:.2f} s vs {local[1]:.2f} s)"
        out.append({"target": name, "limit": f"<= {limit} x", "value": round(value, 4), "pass": value <= limit,
                    "note": note})
    return out


def check_restored(method, target, expected_files):
    files, _ = count_entries(target)
    if files != expected_files:
        raise BenchError(f"{method} restored {files} files into {target}, the workspace has {expected_files}")


def fmt_seconds(values):
    if not values:
        return "n/a"
    digits = 3 if max(values) < 0.1 else 2  # the unchanged row is a matter of milliseconds
    return f"{min(values):.{digits}f} / {statistics.median(values):.{digits}f} / {max(values):.{digits}f}"


def table(results):
    lines = ["| step | method | wall s (min / median / max) | bytes to store (median) | notes |",
             "|---|---|---|---|---|"]
    for step in results.steps:
        for method in METHODS:
            cell = results.data[step][method]
            why = results.not_applicable.get((step, method))
            if why:
                lines.append(f"| {step} | {method} | n/a | n/a | {why} |")
                continue
            if not cell["wall_s"]:
                lines.append(f"| {step} | {method} | n/a | n/a | not measured |")
                continue
            stored = [b for b in cell["bytes"] if b is not None]
            shown = human_bytes(statistics.median(stored)) if stored else "—"
            notes = []
            growth = [d["store_growth"] for d in cell["detail"] if "store_growth" in d]
            if growth:
                notes.append(f"blob dir grew {human_bytes(statistics.median(growth))}")
            read = [d["files_read"] for d in cell["detail"] if "files_read" in d]
            if read:
                notes.append(f"{int(statistics.median(read))} files read")
            waits = [d["upload_wait_ms"] for d in cell["detail"] if d.get("upload_wait_ms") is not None]
            if waits:
                notes.append(f"waited {statistics.median(waits):.0f} ms for uploads")
            rss = [d["maxrss_kib"] for d in cell["detail"] if d.get("maxrss_kib") is not None]
            if rss:
                notes.append(f"peak RSS {human_bytes(max(rss) * 1024)} (worst)")
            down = [d["bytes_downloaded"] for d in cell["detail"] if d.get("bytes_downloaded") is not None]
            if down:
                notes.append(f"{human_bytes(statistics.median(down))} read from the store")
            extra = [d["note"] for d in cell["detail"] if d.get("note")]
            if extra:
                notes.append(extra[-1])
            lines.append(f"| {step} | {method} | {fmt_seconds(cell['wall_s'])} | {shown} | {'; '.join(notes)} |")
        if step == "restore" and results.write_floor["wall_s"]:
            threads = max(results.write_floor["threads"])
            lines.append(f"| {step} | write floor | {fmt_seconds(results.write_floor['wall_s'])} | n/a | "
                         f"the same files from memory, {threads} threads: nothing downloaded, decompressed "
                         f"or checked |")
    return "\n".join(lines)


def targets(results):
    out = []

    def ratio(name, step, baseline_step, baseline, limit):
        mine, theirs = results.median(step, "cairn"), results.median(baseline_step, baseline)
        if mine is None or theirs is None or theirs == 0:
            out.append({"target": name, "limit": f"<= {limit} x", "value": None, "pass": None,
                        "note": f"{baseline} not measured"})
            return
        value = mine / theirs
        out.append({"target": name, "limit": f"<= {limit} x", "value": round(value, 4), "pass": value <= limit,
                    "note": f"cairn {mine:.2f} s vs {baseline} {theirs:.2f} s"})

    ratio("full checkpoint wall vs tar-gz", "full", "full", "tar-gz", 0.5)
    ratio("incremental checkpoint wall vs restic incremental", "incremental", "incremental", "restic", 0.1)
    worst = results.worst_bytes("incremental", "cairn")
    out.append({"target": "incremental checkpoint uploaded bytes", "limit": f"<= {INCREMENTAL_BYTES_TARGET} B",
                "value": worst, "pass": None if worst is None else worst <= INCREMENTAL_BYTES_TARGET,
                "note": "worst repeat"})
    ratio("restore wall vs tar-gz restore", "restore", "restore", "tar-gz", 0.5)
    floor = statistics.median(results.write_floor["wall_s"]) if results.write_floor["wall_s"] else None
    if floor:
        multiples = [f"{method}'s restore {results.median('restore', method) / floor:.2f} x it"
                     for method in ["cairn", "tar-gz"] if results.median("restore", method) is not None]
        out[-1]["note"] += f"; write floor {floor:.2f} s (" + ", ".join(multiples) + ")"
    out.extend(restore_speed_targets(results))
    out.extend(issue5_targets(results))
    return out


def excluding_upload(results, step):
    """Median over repeats of cairn's wall less what it waited for uploads: (seconds, why not)."""
    per_repeat = per_repeat_excluding_upload(results, step)
    if not per_repeat:
        return None, f"{step} not measured"
    if any(s is None for s in per_repeat):
        return None, "the runner's stats have no upload_wait_ms"
    return statistics.median(per_repeat), None


def per_repeat_excluding_upload(results, step):
    """cairn's wall less its upload wait, per repeat (None where the runner did not say)."""
    if step not in results.data:
        return []
    walls = results.data[step]["cairn"]["wall_s"]
    waits = results.details(step, "cairn", "upload_wait_ms")
    return [None if ms is None else w - ms / 1000 for w, ms in zip(walls, waits)]


def seconds_row(name, limit_s, value, note):
    return {"target": name, "limit": f"<= {limit_s:.3f} s", "value": None if value is None else round(value, 4),
            "shown": None if value is None else f"{value:.3f} s",
            "pass": None if value is None else value <= limit_s, "note": note}


def issue5_targets(results):
    """Issue 5: unchanged workspace, incremental excluding upload, peak memory, the 4x workspace."""
    out = []
    why = results.not_applicable.get(("unchanged", "cairn"), "not measured")
    wall = results.median("unchanged", "cairn")
    out.append(seconds_row("unchanged workspace: checkpoint --if-changed wall", UNCHANGED_WALL_TARGET_S, wall,
                           why if wall is None else "median, the watcher resident"))
    growth = [g for g in results.details("unchanged", "cairn", "store_growth") if g is not None]
    since = results.details("unchanged", "cairn", "unchanged_since")
    if growth:
        said = sum(1 for s in since if s is not None)
        out.append({"target": "unchanged workspace: nothing uploaded", "limit": "0 B and unchanged_since",
                    "value": max(growth), "pass": max(growth) == 0 and said == len(since),
                    "note": f"worst repeat's blob dir growth; unchanged_since in {said} of {len(since)} repeats"})
    else:
        out.append({"target": "unchanged workspace: nothing uploaded", "limit": "0 B and unchanged_since",
                    "value": None, "pass": None, "note": why})

    value, why_not = excluding_upload(results, "incremental")
    out.append(seconds_row("incremental checkpoint wall excluding upload", INCREMENTAL_EXCLUDING_UPLOAD_TARGET_S,
                           value, why_not or "median of wall - upload_wait_ms"))

    rss = [r for r in results.details("full", "cairn", "maxrss_kib") if r is not None]
    worst = max(rss) * 1024 if rss else None
    out.append({"target": "peak runner memory during the full checkpoint",
                "limit": f"<= {human_bytes(FULL_PEAK_RSS_TARGET)}", "value": worst,
                "pass": None if worst is None else worst <= FULL_PEAK_RSS_TARGET,
                "note": "worst repeat's ru_maxrss" if rss else "not measured"})

    name = "4x workspace: incremental wall excluding upload vs 1x"
    limit = f"< {LARGE_INCREMENTAL_FACTOR:g} x"
    if "incremental-4x" not in results.data:
        out.append({"target": name, "limit": limit, "value": None, "pass": None, "note": "4x workspace skipped"})
        out.append({"target": "4x workspace: incremental uploaded bytes", "limit": f"<= {INCREMENTAL_BYTES_TARGET} B",
                    "value": None, "pass": None, "note": "4x workspace skipped"})
        return out
    large, why_large = excluding_upload(results, "incremental-4x")
    small, why_small = excluding_upload(results, "incremental")
    restic_large, restic_small = results.median("incremental-4x", "restic"), results.median("incremental", "restic")
    restic_note = (f"restic incremental 4x/1x = {restic_large / restic_small:.2f} x "
                   f"({restic_large:.2f} s vs {restic_small:.2f} s; restic grows with the tree)"
                   if restic_large is not None and restic_small else "restic not measured")
    # Repeat k on either workspace is agent turn k (make_workspace.py --turn k: the same edits, a commit on
    # even turns), so turns are compared with the same turn: the medians of --repeat and --large-repeat
    # runs would pick a commit turn on one side and not on the other.
    matched = [(k + 1, big / little) for k, (big, little) in
               enumerate(zip(per_repeat_excluding_upload(results, "incremental-4x"),
                             per_repeat_excluding_upload(results, "incremental")))
               if big is not None and little]
    if large is None or small is None or small <= 0 or not matched:
        out.append({"target": name, "limit": limit, "value": None, "pass": None,
                    "note": (why_large or why_small or "no turn measured on both") + "; " + restic_note})
    else:
        turn, value = max(matched, key=lambda m: m[1])
        turns = ", ".join(f"turn {k}{' (commit)' if k % 2 == 0 else ''} {r:.2f} x" for k, r in matched)
        out.append({"target": name, "limit": limit, "value": round(value, 4), "pass": value < LARGE_INCREMENTAL_FACTOR,
                    "note": f"the worst of the same turns on both: {turns}; medians {large:.3f} s vs "
                            f"{small:.3f} s = {large / small:.2f} x (mixing turn kinds); {restic_note}"})
    worst = results.worst_bytes("incremental-4x", "cairn")
    out.append({"target": "4x workspace: incremental uploaded bytes", "limit": f"<= {INCREMENTAL_BYTES_TARGET} B",
                "value": worst, "pass": None if worst is None else worst <= INCREMENTAL_BYTES_TARGET,
                "note": "worst repeat"})
    return out


def targets_table(rows):
    lines = ["| target | limit | cairn | result | |", "|---|---|---|---|---|"]
    for r in rows:
        verdict = "SKIP" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        value = "n/a" if r["value"] is None else r.get("shown") or (
            f"{r['value']:.3f} x" if isinstance(r["value"], float) else human_bytes(r["value"]))
        lines.append(f"| {r['target']} | {r['limit']} | {value} | {verdict} | {r['note']} |")
    return "\n".join(lines)


def build_workspace(root, flags):
    """make_workspace.py ROOT FLAGS, then the racy-timestamp guard; returns (files, dirs, bytes)."""
    log(f"building the workspace in {root}")
    run([sys.executable, MAKE_WORKSPACE, root] + flags)
    files, dirs = count_entries(root)
    size = tree_bytes(root)
    log(f"workspace: {files} files, {dirs} directories, {human_bytes(size)}")
    # The runner does not trust the fingerprint of a file changed within 2 s
    # of its scan (racy timestamps). An agent's workspace is older than that;
    # one generated a moment ago is not, and would be re-read next time.
    time.sleep(RACY_GUARD_S)
    return files, dirs, size


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, help="tracked files (make_workspace.py default when omitted)")
    ap.add_argument("--ignored", type=int, help="ignored files (make_workspace.py default when omitted)")
    ap.add_argument("--transcript-mb", type=int, help="transcript size (make_workspace.py default when omitted)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of every measurement (default 3)")
    ap.add_argument("--store-mib-s", type=int, default=STORE_LINK_MIB_S,
                    help="bandwidth of the link to the blob store for the two restores sharing a host pack cache, "
                         f"in MiB/s (default {STORE_LINK_MIB_S}; 0: loopback only)")
    ap.add_argument("--large-files", type=int, default=LARGE_FILES,
                    help=f"tracked files of the 4x workspace (default {LARGE_FILES})")
    ap.add_argument("--large-ignored", type=int, default=LARGE_IGNORED,
                    help=f"ignored files of the 4x workspace (default {LARGE_IGNORED})")
    ap.add_argument("--large-repeat", type=int, help="repeats on the 4x workspace (default --repeat)")
    ap.add_argument("--no-large", action="store_true", help="skip the 4x workspace")
    ap.add_argument("--only", choices=["resume"],
                    help="measure only this row (resume: answer -> harness started on another host, and suspend)")
    ap.add_argument("--no-resume", action="store_true", help="skip the resume row")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"),
                    help="where the cairn binaries are (default target/release)")
    ap.add_argument("--workdir", help="where to build workspaces and stores (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.large_repeat is None:
        args.large_repeat = args.repeat
    if args.large_repeat < 1:
        ap.error("--large-repeat must be at least 1")
    if args.only == "resume" and args.no_resume:
        ap.error("--only resume and --no-resume exclude each other")
    only_resume = args.only == "resume"
    if only_resume:
        args.no_large = True

    bins = binaries(args.bin_dir)
    if not args.no_resume and not local_sandboxes_work():
        why = ("the resume row runs cairn-host's local driver, which needs root or unprivileged user "
               "namespaces (`unshare --user --map-root-user --mount true` failed)")
        if only_resume:
            sys.exit(why)
        log(why + ": skipped")
        args.no_resume = True
    for path in [MAKE_WORKSPACE, BASELINES]:
        if not os.path.isfile(path):
            sys.exit(f"{path} is missing (the shared bench kit is expected at ../shared/bench)")
    have_restic = shutil.which("restic") is not None
    if not have_restic:
        log("restic is not installed (Debian: apt-get install restic): its rows and the "
            "incremental-vs-restic target are skipped")

    work = args.workdir or tempfile.mkdtemp(prefix="cairn-bench-")
    os.makedirs(work, exist_ok=True)
    global SPENT_DIR
    SPENT_DIR = os.path.join(work, "spent")
    workspace_root = os.path.join(work, "workspace")
    flags = []
    for flag, value in [("--files", args.files), ("--ignored", args.ignored), ("--transcript-mb", args.transcript_mb)]:
        if value is not None:
            flags += [flag, str(value)]
    large_root = os.path.join(work, "workspace-4x")
    large_flags = ["--files", str(args.large_files), "--ignored", str(args.large_ignored)]
    if args.transcript_mb is not None:
        large_flags += ["--transcript-mb", str(args.transcript_mb)]
    large = None

    results = Results([] if only_resume else [s for s in STEPS if not (args.no_large and s in LARGE_STEPS)])
    resume = None if args.no_resume else ResumeResults()
    for method, why in [
            ("tar-gz", "no change detection: every checkpoint archives the whole workspace (its incremental row)"),
            ("parts", "no change detection: every checkpoint rewrites its bundle, diff and archives "
                      "(its incremental row)"),
            ("restic", "no skip: `restic backup` rescans the tree and writes a snapshot (its incremental row)")]:
        results.na("unchanged", method, why)
    if not args.no_large:
        results.na("full-4x", "parts", "not measured on the 4x workspace")
        results.na("incremental-4x", "parts", "not measured on the 4x workspace")
        results.na("incremental-4x", "tar-gz", "as its full-4x: tar-gz archives the whole workspace again")
    if not have_restic:
        for step in results.steps:
            results.na(step, "restic", "restic not installed")
    try:
        files, dirs, size = build_workspace(workspace_root, flags)
        if not only_resume:
            for i in range(args.repeat):
                one_repeat(i, args, bins, work, workspace_root, results, have_restic)
        if resume is not None:
            for i in range(args.repeat):
                resume_repeat(i, args, bins, work, workspace_root, resume)
        if not args.no_large:
            large = build_workspace(large_root, large_flags)
            for i in range(args.large_repeat):
                one_large_repeat(i, args, bins, work, large_root, results, have_restic)
            if not args.keep:
                set_aside(large_root)
                set_aside(large_root + ".remote.git")
    except BenchError as e:
        sys.exit(f"benchmark failed: {e}")
    finally:
        shutil.rmtree(SPENT_DIR, ignore_errors=True)
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    rows = ([] if only_resume else targets(results)) + ([] if resume is None else resume_targets(resume))
    print(f"Workspace: {files} files, {dirs} directories, {human_bytes(size)}; "
          f"{args.repeat} repeat(s); page caches warm (they cannot be dropped here).")
    if large:
        print(f"4x workspace (full-4x, incremental-4x): {large[0]} files, {large[1]} directories, "
              f"{human_bytes(large[2])}; {args.large_repeat} repeat(s).")
    print()
    if not only_resume:
        print(table(results))
        print()
    if resume is not None:
        print(f"Resume: coordinator --heartbeat-interval 1s --host-lease 10s (its defaults); two cairn-host "
              f"--driver local --slots 1; the demo agent as claude; hold {RESUME_HOLD_S} s; host A cordoned for "
              f"B's resumes and B for A's; times from the run's events (coordinator clock, ms).")
        print()
        print(resume_table(resume))
        print()
    print(targets_table(rows))
    if args.json:
        doc = {
            "workspace": {"files": files, "directories": dirs, "bytes": size,
                          "make_workspace_flags": flags},
            "large_workspace": None if not large else {
                "files": large[0], "directories": large[1], "bytes": large[2],
                "make_workspace_flags": large_flags, "repeat": args.large_repeat},
            "repeat": args.repeat,
            "results": results.data,
            "write_floor": results.write_floor,
            "not_applicable": {f"{s}/{m}": why for (s, m), why in results.not_applicable.items()},
            "targets": rows,
            "resume": None if resume is None else {
                "hold_s": RESUME_HOLD_S, "legs": RESUME_LEGS, "resumes": resume.resumes,
                "suspends": resume.suspends},
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        log(f"results written to {args.json}")
    return 0 if all(r["pass"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
