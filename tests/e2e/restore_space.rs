//! A restore onto a filesystem too small for it (issue 28): refused before
//! writing when blocks or inodes are short, and a disk that fills anyway
//! mid-restore leaves no partial tree that passes for the workspace (what
//! was written into an empty root is removed; a root that held files is
//! marked). Each restore runs on a small tmpfs mounted in a private mount
//! namespace (needs root).

use std::path::Path;
use std::process::Command;

use cairn_e2e::{Client, Coordinator, Outcome, run, tempdir, write, write_pseudo_random};

/// Mounts a tmpfs (`$OPTS`) on `$1`, optionally prepares it, runs the rest
/// of the arguments (the restore into `$1/ws`), and lists what is left.
const SCRIPT: &str = r#"
M="$1"; shift
mount -t tmpfs -o "$OPTS" none "$M" || exit 90
if [ -n "${OLD:-}" ]; then mkdir -p "$M/ws" && echo old > "$M/ws/old.txt"; fi
if [ -n "${FILL:-}" ]; then
  # The restore stops (a failpoint) once its space check passed and it
  # marked the root; the disk is filled then, and the restore goes on.
  CAIRN_FAILPOINTS=restore-after-mark=stop "$@" &
  pid=$!
  tries=0
  while [ "$(awk '{print $3}' /proc/$pid/stat 2>/dev/null)" != T ]; do
    kill -0 $pid 2>/dev/null || break
    tries=$((tries + 1)); [ $tries -gt 6000 ] && { echo "the restore never stopped"; kill -9 $pid; break; }
    sleep 0.01
  done
  dd if=/dev/zero of="$M/filler" bs=64k 2>/dev/null
  kill -CONT $pid 2>/dev/null
  wait $pid
  code=$?
else
  "$@"
  code=$?
fi
echo "restore-exit=$code"
[ -d "$M/ws" ] && find "$M/ws" -mindepth 1 | sort | sed 's/^/left: /'
exit 0
"#;

fn restore_on_tmpfs(client: &Client, workspace: &str, opts: &str, env: &[(&str, &str)]) -> Outcome {
    let tmp = tempdir("tmpfs");
    let mount = tmp.path().join("m");
    std::fs::create_dir(&mount).unwrap();
    let base = client.runner();
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private", "sh", "-c", SCRIPT, "sh"])
        .arg(&mount)
        .arg(base.get_program())
        .args(["restore", "--root"])
        .arg(mount.join("ws"))
        .args(["--workspace", workspace]);
    for (key, value) in base.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    cmd.env("OPTS", opts);
    for (key, value) in env {
        cmd.env(key, value);
    }
    run(&mut cmd)
}

fn exit_of(outcome: &Outcome) -> i32 {
    outcome
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("restore-exit="))
        .unwrap_or_else(|| panic!("no restore ran: {}", outcome.all_output()))
        .parse()
        .unwrap()
}

fn left(outcome: &Outcome) -> Vec<String> {
    outcome
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("left: "))
        .map(|l| {
            Path::new(l)
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

fn checkpointed(coordinator: &Coordinator, name: &str, fill: impl FnOnce(&Path)) -> String {
    let tmp = tempdir(name);
    let root = tmp.path().join("ws");
    fill(&root);
    let workspace = coordinator.create_workspace(name);
    coordinator.client().checkpoint(&root, &workspace);
    workspace
}

#[test]
fn a_restore_too_big_for_the_blocks_or_inodes_is_refused_before_writing() {
    let coordinator = Coordinator::start();
    let client = coordinator.client();

    let big = checkpointed(&coordinator, "big", |root| {
        write_pseudo_random(&root.join("data.bin"), 2 << 20, 1);
    });
    let outcome = restore_on_tmpfs(&client, &big, "size=1m,nr_inodes=1000", &[]);
    assert_ne!(exit_of(&outcome), 0, "{}", outcome.all_output());
    let said = outcome.all_output();
    assert!(
        said.contains("in whole blocks") && said.contains("nothing was written"),
        "{said}"
    );
    assert!(said.contains("2.0 MiB") || said.contains("MiB"), "{said}");
    assert_eq!(left(&outcome), Vec::<String>::new());

    // 300 files of a few bytes: 1.5 KiB of data, 300 inodes.
    let many = checkpointed(&coordinator, "many", |root| {
        for i in 0..300 {
            write(&root.join(format!("d{}/f{i}", i % 10)), format!("{i}\n"));
        }
    });
    let outcome = restore_on_tmpfs(&client, &many, "size=64m,nr_inodes=100", &[]);
    assert_ne!(exit_of(&outcome), 0, "{}", outcome.all_output());
    let said = outcome.all_output();
    assert!(
        // 300 files, 10 directories and the restore's marker file.
        said.contains("311 inodes") && said.contains("inodes free"),
        "{said}"
    );
    assert_eq!(left(&outcome), Vec::<String>::new());

    // The same restores fit a big enough tmpfs.
    let outcome = restore_on_tmpfs(&client, &many, "size=64m,nr_inodes=1000", &[]);
    assert_eq!(exit_of(&outcome), 0, "{}", outcome.all_output());
    assert!(!left(&outcome).contains(&".cairn-restore-incomplete".to_owned()));
}

#[test]
fn a_disk_that_fills_mid_restore_leaves_no_tree_passing_for_the_workspace() {
    let coordinator = Coordinator::start();
    let client = coordinator.client();
    // 3.1 MiB on a 16 MiB disk: it fits, until the disk is filled while
    // the restore is stopped right after its space check.
    let workspace = checkpointed(&coordinator, "filling", |root| {
        for i in 0..100 {
            write_pseudo_random(&root.join(format!("d{}/f{i}", i % 10)), 32 << 10, i);
        }
    });

    // Into an empty root: what was written is removed.
    let outcome = restore_on_tmpfs(
        &client,
        &workspace,
        "size=16m,nr_inodes=10000",
        &[("FILL", "1")],
    );
    let said = outcome.all_output();
    assert!(
        said.contains("failpoint restore-after-mark reached: stopped"),
        "the disk is filled after the space check: {said}"
    );
    assert_ne!(exit_of(&outcome), 0, "{said}");
    assert!(said.contains("was not restored"), "{said}");
    assert!(said.contains("No space left on device"), "{said}");
    assert!(said.contains("the filesystem filled up"), "{said}");
    assert!(said.contains("what it wrote was removed"), "{said}");
    assert_eq!(left(&outcome), Vec::<String>::new(), "{said}");

    // Into a root that held a tree: marked as partial.
    let outcome = restore_on_tmpfs(
        &client,
        &workspace,
        "size=16m,nr_inodes=10000",
        &[("FILL", "1"), ("OLD", "1")],
    );
    let said = outcome.all_output();
    assert_ne!(exit_of(&outcome), 0, "{said}");
    assert!(said.contains("marked by"), "{said}");
    assert!(
        left(&outcome).contains(&".cairn-restore-incomplete".to_owned()),
        "{said}"
    );
}
