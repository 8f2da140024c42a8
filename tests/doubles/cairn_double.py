"""Shared by the test doubles (codex, gemini, pi, opencode, goose, openhands,
aider): the demo agent's directives (perform() returns a Turn: the lines
said, why the turn failed, and whether the model provider refused it), the
record of credentials a turn saw, the git work tree and dotenv files the
CLIs look at, refusing to run, and, for the SQLite-backed doubles, a
database kept in WAL mode whose WAL is left in place when the process ends.

commit <path> <text>   write text to path, git add + commit (in the cwd)
edit <path> <text>     append text to path (left uncommitted)
recall <word>          what the FIRST user message of the conversation said
                       about <word> (as runner/demo-agent/src/script.rs says it)
ask <question>         end the turn asking a person (writes $CAIRN_OUTCOME_FILE)
api-error              the model provider refuses the turn (HTTP 401, as with
                       a bad key) before the model says or does anything: no
                       directive of the message is carried out, and each
                       double fails the turn the way its real CLI does

Other lines are only remembered (they are in the transcript).
"""

import collections
import hashlib
import json
import os
import sqlite3
import subprocess
import sys

# What the model provider answers to a turn with an `api-error` line.
API_ERROR = ('401 Unauthorized: {"type":"error","error":{"type":"authentication_error",'
             '"message":"invalid x-api-key"}}')

# What perform() returns: the lines the model said, why the turn failed (or
# None), and whether it failed as the model provider refusing it (then
# `said` is empty and `error` is API_ERROR).
Turn = collections.namedtuple("Turn", ["said", "error", "api_error"])

FILLER = {"is", "was", "are", "were", "=", ":", "-", "to", "be", "will", "shall", "of", "it's"}


def _clean(token):
    start, end = 0, len(token)
    while start < end and not token[start].isalnum():
        start += 1
    while end > start and not token[end - 1].isalnum():
        end -= 1
    return token[start:end]


def recall(message, word):
    tokens = message.split()
    wanted = _clean(word).lower()
    for i, token in enumerate(tokens):
        if _clean(token).lower() != wanted:
            continue
        for t in tokens[i + 1:]:
            value = _clean(t)
            if value and value.lower() not in FILLER:
                return f"the {wanted} was {value}"
    return f"the first message said nothing about {wanted}"


def _inside(cwd, path):
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{path!r} is not a relative path inside {cwd}")
    return os.path.join(cwd, path)


def _write(cwd, path, text, mode):
    full = _inside(cwd, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, mode) as f:
        f.write(text + "\n")
    return full


def _commit(cwd, path, text):
    _write(cwd, path, text, "w")
    git = ["git", "-c", "user.name=cairn test double", "-c", "user.email=double@cairn.invalid"]
    inside = subprocess.run(git + ["rev-parse", "--is-inside-work-tree"], cwd=cwd,
                            capture_output=True, text=True)
    if inside.returncode != 0:
        subprocess.run(git + ["init", "-q"], cwd=cwd, check=True)
    subprocess.run(git + ["add", "--", path], cwd=cwd, check=True)
    subprocess.run(git + ["commit", "-q", "-m", f"test double: {path}"], cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL)


def perform(message, cwd, first_message):
    """Carries out the message's directives; returns a Turn (said lines,
    error or None, api_error). A message with an `api-error` line fails as
    the model provider's refusal would, before any directive runs."""
    if any(line.strip() == "api-error" for line in message.splitlines()):
        return Turn([], API_ERROR, True)
    said = []
    for line in message.splitlines():
        line = line.strip()
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        path, _, text = rest.partition(" ")
        text = text.strip()
        try:
            if word == "commit" and path:
                _commit(cwd, path, text)
                said.append(f"committed {path}")
            elif word == "edit" and path:
                _write(cwd, path, text, "a")
                said.append(f"edited {path}")
            elif word == "recall" and rest:
                said.append(recall(first_message, rest))
            elif word == "ask" and rest:
                outcome = os.environ.get("CAIRN_OUTCOME_FILE")
                if not outcome:
                    return Turn(said, "CAIRN_OUTCOME_FILE is not set", False)
                os.makedirs(os.path.dirname(outcome), exist_ok=True)
                with open(outcome, "w") as f:
                    json.dump({"status": "needs_input", "question": rest}, f)
                said.append(f"asked: {rest}")
        except (OSError, ValueError, subprocess.CalledProcessError) as e:
            return Turn(said, str(e), False)
    return Turn(said, None, False)


def summary(said):
    return "; ".join(said) if said else "nothing to do: the message had no directives"


def git_root(cwd):
    """The top of the git work tree that holds `cwd`, or None when `cwd`
    is in none (`git rev-parse --show-toplevel`)."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True)
    except OSError:
        return None
    if top.returncode != 0:
        return None
    return top.stdout.strip() or None


def read_env_file(path):
    """The NAME=value lines of a dotenv file (`export ` prefixes, comments
    and quotes as dotenv reads them), as a dict; {} when there is none."""
    values = {}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return values
    for line in lines:
        line = line.strip()
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        name, eq, value = line.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name or name.startswith("#"):
            continue
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = value
    return values


def credential_seen(path):
    """The record of one credential file at `path`, if it is there: path
    and SHA-256 (never the content)."""
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return {"path": path, "sha256": hashlib.sha256(f.read()).hexdigest()}


def credentials_seen(directory, files):
    """Which credential files (paths relative to `directory`) exist at their
    documented place, each with its record (see credential_seen)."""
    seen = {name: credential_seen(os.path.join(directory, name)) for name in files}
    return {name: record for name, record in seen.items() if record}


def open_wal(path, schema):
    """Opens (creating) the SQLite database at `path` in WAL mode, with
    automatic checkpoints off, so that what a turn writes stays in the
    `-wal` file, as a harness that is still running (or was killed) leaves
    it. `schema` is run once (CREATE TABLE IF NOT EXISTS ...)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode != "wal":
        raise RuntimeError(f"{path}: journal mode {mode}, not wal")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.executescript(schema)
    return db


def fail(message, code=1):
    """Says why on stderr and ends the process with `code` (see leave)."""
    print(message, file=sys.stderr)
    leave(code)


def leave(code):
    """Ends the process at once, without closing the database: SQLite
    would checkpoint the WAL into the main file (and delete it) on close,
    and the point is that the WAL carries the turns."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
