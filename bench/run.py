#!/usr/bin/env python3
"""Benchmark cairn against the peers' ways of checkpointing a workspace.

    cargo build --release --bins && python3 bench/run.py [--files N --ignored N] [--repeat 3] [--json out.json]

Builds a workspace with ../shared/bench/make_workspace.py, then measures in
one run, side by side, for each method:

  full         checkpoint of the whole workspace into an empty store
  incremental  checkpoint after one simulated agent turn (make_workspace.py --turn)
  restore      the incremental checkpoint into an empty directory
  restore-baked
               the same onto a baked older copy: the target is first filled
               with `cp -a` of the workspace as it was before the agent turn
               (cairn with a fresh runner cache; tar-gz untars over it; restic
               restores over it; neither of those removes stale entries)
  restore-cold-cache, restore-warm-cache
               cairn only: two restores into empty directories sharing one
               host pack cache (--pack-cache), each with a fresh runner cache,
               as two sandboxes of one host; the peers have no such cache

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
tar-gz and parts, the growth of restic's repository.

Targets from issue 2, checked on medians (bytes on the worst repeat); the exit
status is 1 when a target is missed:
  full checkpoint         cairn wall <= 0.5 x tar-gz wall
  incremental checkpoint  cairn wall <= 0.1 x restic incremental wall, and <= 300 KB uploaded
  restore                 cairn wall <= 0.5 x tar-gz restore wall
and from issue 5:
  restore onto baked copy cairn restore-baked wall <= 0.2 x cairn restore wall
  warm host cache         cairn restore-warm-cache wall <= 0.3 x restore-cold-cache wall
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_BENCH = os.path.normpath(os.path.join(REPO, "..", "shared", "bench"))
MAKE_WORKSPACE = os.path.join(SHARED_BENCH, "make_workspace.py")
BASELINES = os.path.join(SHARED_BENCH, "baselines.sh")
INCREMENTAL_BYTES_TARGET = 300_000
RACY_GUARD_S = 3.1

METHODS = ["cairn", "tar-gz", "parts", "restic"]
STEPS = ["full", "incremental", "restore"]
RESTORE_SPEED_STEPS = ["restore-baked", "restore-cold-cache", "restore-warm-cache"]
STEPS += RESTORE_SPEED_STEPS


class BenchError(Exception):
    """A step of the benchmark failed; the message says which and why."""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd, env=None, cwd=None):
    """Runs cmd, returns (seconds, stdout); raises BenchError with stderr on failure."""
    # Flush what earlier steps left dirty, so that no step pays for another's
    # writeback (the page cache itself cannot be dropped here).
    os.sync()
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        raise BenchError(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stderr.strip()[-2000:]}")
    return elapsed, proc.stdout


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
    paths = {name: os.path.join(profile_dir, name) for name in ["cairn-coordinator", "cairn-runner", "cairnctl"]}
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
    def __init__(self):
        self.data = {step: {m: {"wall_s": [], "bytes": [], "detail": []} for m in METHODS} for step in STEPS}
        self.not_applicable = {}

    def add(self, step, method, seconds, stored=None, **detail):
        cell = self.data[step][method]
        cell["wall_s"].append(round(seconds, 4))
        cell["bytes"].append(stored)
        cell["detail"].append(detail)

    def na(self, step, method, why):
        self.not_applicable[(step, method)] = why

    def median(self, step, method):
        walls = self.data[step][method]["wall_s"]
        return statistics.median(walls) if walls else None

    def worst_bytes(self, step, method):
        values = [b for b in self.data[step][method]["bytes"] if b is not None]
        return max(values) if values else None


def cairn_checkpoint(bins, coordinator, root, workspace, cache_dir, socket=None):
    via = ["--socket", socket] if socket else []
    seconds, out = run([bins["cairn-runner"], "checkpoint", "--root", root, "--workspace", workspace,
                        "--output", "json"] + via, env=coordinator.env(cache_dir))
    report = json.loads(out)
    return seconds, report


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
        run([bins["cairnctl"], "--output", "json", "workspace", "create", "--name", "bench"],
            env=coordinator.env(cache))
        before = tree_bytes(coordinator.blobs_dir)
        seconds, report = cairn_checkpoint(bins, coordinator, workspace_root, "bench", cache)
        grown = tree_bytes(coordinator.blobs_dir) - before
        results.add("full", "cairn", seconds, report["stats"]["uploaded_bytes"], store_growth=grown,
                    files=report["stats"]["files"], total_bytes=report["stats"]["total_bytes"])

        tgz_full = os.path.join(rep, "tar-gz-full")
        seconds, _ = run(["bash", BASELINES, "tar-gz", workspace_root, tgz_full])
        results.add("full", "tar-gz", seconds, tree_bytes(tgz_full))
        parts_full = os.path.join(rep, "parts-full")
        seconds, _ = run(["bash", BASELINES, "parts", workspace_root, parts_full])
        results.add("full", "parts", seconds, tree_bytes(parts_full))
        restic_repo = os.path.join(rep, "restic-repo")
        if have_restic:
            run(["restic", "init", "--quiet", "--repo", restic_repo], env=dict(os.environ, RESTIC_PASSWORD="bench"))
            before = tree_bytes(restic_repo)
            seconds, _ = run(["bash", BASELINES, "restic", workspace_root, restic_repo])
            results.add("full", "restic", seconds, tree_bytes(restic_repo) - before)

        # In a sandbox the runner is resident and watches the workspace; so here.
        socket = os.path.join(rep, "watch.sock")
        watcher = Watcher(bins, coordinator, workspace_root, "bench", cache, socket, os.path.join(rep, "watch.log"))
        baked = bake_before_turn(workspace_root, rep)
        log(f"repeat {turn}/{args.repeat}: agent turn {turn}, incremental checkpoints")
        run([sys.executable, MAKE_WORKSPACE, workspace_root, "--turn", str(turn)])
        before = tree_bytes(coordinator.blobs_dir)
        try:
            seconds, report = cairn_checkpoint(bins, coordinator, workspace_root, "bench", cache, socket)
        finally:
            watcher.stop()
        grown = tree_bytes(coordinator.blobs_dir) - before
        results.add("incremental", "cairn", seconds, report["stats"]["uploaded_bytes"], store_growth=grown,
                    files_read=report["stats"]["files_read"])
        tgz_incr = os.path.join(rep, "tar-gz-incremental")
        seconds, _ = run(["bash", BASELINES, "tar-gz", workspace_root, tgz_incr])
        results.add("incremental", "tar-gz", seconds, tree_bytes(tgz_incr))
        parts_incr = os.path.join(rep, "parts-incremental")
        seconds, _ = run(["bash", BASELINES, "parts", workspace_root, parts_incr])
        results.add("incremental", "parts", seconds, tree_bytes(parts_incr))
        if have_restic:
            before = tree_bytes(restic_repo)
            seconds, _ = run(["bash", BASELINES, "restic", workspace_root, restic_repo])
            results.add("incremental", "restic", seconds, tree_bytes(restic_repo) - before)

        log(f"repeat {turn}/{args.repeat}: restores into empty directories")
        expected_files, _ = count_entries(workspace_root)
        target = os.path.join(rep, "restore-cairn")
        fresh_cache = os.path.join(rep, "restore-cache")
        seconds, out = run([bins["cairn-runner"], "restore", "--root", target, "--workspace", "bench",
                            "--output", "json"], env=coordinator.env(fresh_cache))
        restored = json.loads(out)
        check_restored("cairn", target, expected_files)
        results.add("restore", "cairn", seconds, None, bytes_downloaded=restored.get("bytes_downloaded"))
        shutil.rmtree(target)

        target = os.path.join(rep, "restore-tar-gz")
        seconds, _ = run(["bash", BASELINES, "untar-gz", os.path.join(tgz_incr, "workspace.tgz"), target])
        check_restored("tar-gz", target, expected_files)
        results.add("restore", "tar-gz", seconds, None, bytes_downloaded=tree_bytes(tgz_incr))
        shutil.rmtree(target)
        results.na("restore", "parts", "parts has no restore")

        if have_restic:
            target = os.path.join(rep, "restore-restic")
            seconds, _ = run(["restic", "restore", "latest", "--quiet", "--repo", restic_repo, "--target", target],
                             env=dict(os.environ, RESTIC_PASSWORD="bench"))
            # restic recreates the absolute source path under the target.
            check_restored("restic", os.path.join(target, workspace_root.lstrip("/")), expected_files)
            results.add("restore", "restic", seconds, None)
            shutil.rmtree(target)

        restore_speed_rows(bins, coordinator, rep, workspace_root, baked, tgz_incr, restic_repo, results,
                           have_restic, expected_files)
    finally:
        coordinator.stop()
    if not args.keep:
        shutil.rmtree(rep, ignore_errors=True)


def bake_before_turn(workspace_root, rep):
    """The workspace before the agent turn, as an image would have baked it."""
    baked = os.path.join(rep, "baked")
    run(["cp", "-a", workspace_root, baked])
    return baked


def prefill(baked, target):
    """Fills target (made anew) with a copy of the baked workspace."""
    if os.path.exists(target):
        shutil.rmtree(target)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    run(["cp", "-a", baked, target])


def stale_note(target, expected_files):
    files, _ = count_entries(target)
    return f"keeps {files - expected_files} stale files" if files > expected_files else ""


def restore_speed_rows(bins, coordinator, rep, workspace_root, baked, tgz_incr, restic_repo, results,
                       have_restic, expected_files):
    """Issue 5: restore onto a baked older copy, and a second restore with a warm host cache."""
    log("restores onto a baked older copy")
    target = os.path.join(rep, "baked-cairn")
    prefill(baked, target)
    seconds, out = run([bins["cairn-runner"], "restore", "--root", target, "--workspace", "bench",
                        "--output", "json"], env=coordinator.env(os.path.join(rep, "baked-cache")))
    report = json.loads(out)
    check_restored("cairn", target, expected_files)
    results.add("restore-baked", "cairn", seconds, None, bytes_downloaded=report.get("bytes_downloaded"),
                note=f"{report.get('files_reused')} files reused, {human_bytes(report.get('bytes_written'))} written, "
                     f"{report.get('entries_removed')} stale entries removed")
    shutil.rmtree(target)

    target = os.path.join(rep, "baked-tar-gz")
    prefill(baked, target)
    seconds, _ = run(["tar", "-C", target, "-xzf", os.path.join(tgz_incr, "workspace.tgz")])
    results.add("restore-baked", "tar-gz", seconds, None, bytes_downloaded=tree_bytes(tgz_incr),
                note="untars every file over the copy; " + (stale_note(target, expected_files) or "no stale files"))
    shutil.rmtree(target)
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
        shutil.rmtree(target)

    log("two restores sharing a host pack cache")
    pack_cache = os.path.join(rep, "host-pack-cache")
    for step, name in [("restore-cold-cache", "first"), ("restore-warm-cache", "second")]:
        target = os.path.join(rep, f"cached-{name}")
        seconds, out = run([bins["cairn-runner"], "restore", "--root", target, "--workspace", "bench",
                            "--pack-cache", pack_cache, "--output", "json"],
                           env=coordinator.env(os.path.join(rep, f"cached-{name}-cache")))
        report = json.loads(out)
        check_restored("cairn", target, expected_files)
        results.add(step, "cairn", seconds, None, bytes_downloaded=report.get("bytes_downloaded"),
                    note=f"{human_bytes(report.get('bytes_from_cache', 0))} from the host cache")
        shutil.rmtree(target)
    shutil.rmtree(pack_cache, ignore_errors=True)
    for step in ["restore-cold-cache", "restore-warm-cache"]:
        for method in ["tar-gz", "parts", "restic"]:
            results.na(step, method, "no host-level cache: every restore is a cold one")


def restore_speed_targets(results):
    out = []
    for name, step, baseline_step, limit in [
            ("restore onto a baked copy vs restore into empty", "restore-baked", "restore", 0.2),
            ("second restore with a warm host cache vs the first", "restore-warm-cache", "restore-cold-cache", 0.3)]:
        mine, theirs = results.median(step, "cairn"), results.median(baseline_step, "cairn")
        if mine is None or not theirs:
            out.append({"target": name, "limit": f"<= {limit} x", "value": None, "pass": None,
                        "note": "not measured"})
            continue
        value = mine / theirs
        out.append({"target": name, "limit": f"<= {limit} x", "value": round(value, 4), "pass": value <= limit,
                    "note": f"cairn {mine:.2f} s vs cairn {baseline_step} {theirs:.2f} s"})
    return out


def check_restored(method, target, expected_files):
    files, _ = count_entries(target)
    if files != expected_files:
        raise BenchError(f"{method} restored {files} files into {target}, the workspace has {expected_files}")


def fmt_seconds(values):
    if not values:
        return "n/a"
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def table(results):
    lines = ["| step | method | wall s (min / median / max) | bytes to store (median) | notes |",
             "|---|---|---|---|---|"]
    for step in STEPS:
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
            down = [d["bytes_downloaded"] for d in cell["detail"] if d.get("bytes_downloaded") is not None]
            if down:
                notes.append(f"{human_bytes(statistics.median(down))} read from the store")
            extra = [d["note"] for d in cell["detail"] if d.get("note")]
            if extra:
                notes.append(extra[-1])
            lines.append(f"| {step} | {method} | {fmt_seconds(cell['wall_s'])} | {shown} | {'; '.join(notes)} |")
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
    out.extend(restore_speed_targets(results))
    return out


def targets_table(rows):
    lines = ["| target | limit | cairn | result | |", "|---|---|---|---|---|"]
    for r in rows:
        verdict = "SKIP" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        value = "n/a" if r["value"] is None else (
            f"{r['value']:.3f} x" if isinstance(r["value"], float) else human_bytes(r["value"]))
        lines.append(f"| {r['target']} | {r['limit']} | {value} | {verdict} | {r['note']} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, help="tracked files (make_workspace.py default when omitted)")
    ap.add_argument("--ignored", type=int, help="ignored files (make_workspace.py default when omitted)")
    ap.add_argument("--transcript-mb", type=int, help="transcript size (make_workspace.py default when omitted)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of every measurement (default 3)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"),
                    help="where the cairn binaries are (default target/release)")
    ap.add_argument("--workdir", help="where to build workspaces and stores (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")

    bins = binaries(args.bin_dir)
    for path in [MAKE_WORKSPACE, BASELINES]:
        if not os.path.isfile(path):
            sys.exit(f"{path} is missing (the shared bench kit is expected at ../shared/bench)")
    have_restic = shutil.which("restic") is not None
    if not have_restic:
        log("restic is not installed (Debian: apt-get install restic): its rows and the "
            "incremental-vs-restic target are skipped")

    work = args.workdir or tempfile.mkdtemp(prefix="cairn-bench-")
    os.makedirs(work, exist_ok=True)
    workspace_root = os.path.join(work, "workspace")
    gen = [sys.executable, MAKE_WORKSPACE, workspace_root]
    for flag, value in [("--files", args.files), ("--ignored", args.ignored), ("--transcript-mb", args.transcript_mb)]:
        if value is not None:
            gen += [flag, str(value)]
    log(f"building the workspace in {workspace_root}")
    run(gen)
    files, dirs = count_entries(workspace_root)
    size = tree_bytes(workspace_root)
    log(f"workspace: {files} files, {dirs} directories, {human_bytes(size)}")
    # The runner does not trust the fingerprint of a file changed within 2 s
    # of its scan (racy timestamps). An agent's workspace is older than that;
    # one generated a moment ago is not, and would be re-read next time.
    time.sleep(RACY_GUARD_S)

    results = Results()
    if not have_restic:
        for step in STEPS:
            results.na(step, "restic", "restic not installed")
    try:
        for i in range(args.repeat):
            one_repeat(i, args, bins, work, workspace_root, results, have_restic)
    except BenchError as e:
        sys.exit(f"benchmark failed: {e}")
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    rows = targets(results)
    print(f"Workspace: {files} files, {dirs} directories, {human_bytes(size)}; "
          f"{args.repeat} repeat(s); page caches warm (they cannot be dropped here).\n")
    print(table(results))
    print()
    print(targets_table(rows))
    if args.json:
        doc = {
            "workspace": {"files": files, "directories": dirs, "bytes": size,
                          "make_workspace_flags": gen[3:]},
            "repeat": args.repeat,
            "results": results.data,
            "not_applicable": {f"{s}/{m}": why for (s, m), why in results.not_applicable.items()},
            "targets": rows,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        log(f"results written to {args.json}")
    return 0 if all(r["pass"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
