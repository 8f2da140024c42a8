//! What a station leaves for itself, and clearing it for the next one.
//!
//! A run may lay files for its station before the harness starts — skills,
//! harness profile files (`CreateRunRequest.lay`). The runner writes them and
//! records what it laid in `.cairn/laid.json`:
//!
//! ```json
//! {"station": "implement", "run_id": "run-…",
//!  "files": [{"path": ".cairn/state/claude/skills/implement/SKILL.md", "sha256": "…"}]}
//! ```
//!
//! The record is checkpointed with the workspace, so whichever host runs
//! next knows what to take away. Before an attempt starts its harness the
//! runner clears what earlier runs laid (a file whose content changed since
//! it was laid is left, and said so) and any outcome file an earlier agent
//! left, then lays its own run's files. The record is written by the runner
//! but lives in the agent's workspace, so every path in it is checked again:
//! a path that leaves the workspace, is absolute, goes into `.git`, or
//! passes through a symlink is refused (never removed), with the reason.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use cairn_proto::stations::{LaidFiles, validate_lay_path};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{listed, outcome};
use crate::harness::OUTCOME_FILE;
use cairn_utils::text::plural;

/// The record of laid files, relative to the root.
pub const LAID_FILE: &str = ".cairn/laid.json";
/// Larger records are not read.
const MAX_RECORD_BYTES: u64 = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct LaidRecord {
    station: String,
    #[serde(default)]
    run_id: String,
    files: Vec<LaidEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct LaidEntry {
    path: String,
    sha256: String,
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Where a relative path is, found without following symlinks.
enum Place {
    At(PathBuf),
    /// A directory on the way does not exist.
    Missing,
}

/// Resolves `rel` (syntax-checked) under `root`, refusing parents that are
/// symlinks or not directories.
fn place(root: &Path, rel: &str) -> Result<Place, String> {
    let components: Vec<&str> = rel.split('/').collect();
    let (last, parents) = components.split_last().expect("split yields one item");
    let mut dir = root.to_path_buf();
    for (i, component) in parents.iter().enumerate() {
        dir.push(component);
        let shown = components[..=i].join("/");
        match fs::symlink_metadata(&dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(meta) if meta.file_type().is_symlink() => {
                return Err(format!("{shown} is a symlink"));
            }
            Ok(_) => return Err(format!("{shown} is not a directory")),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Place::Missing),
            Err(e) => return Err(format!("cannot inspect {shown}: {e}")),
        }
    }
    Ok(Place::At(dir.join(last)))
}

/// What clearing found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cleared {
    /// The station that laid the files (from the record).
    pub station: String,
    /// Removed, as laid.
    pub removed: Vec<String>,
    /// Left in place: their content changed since they were laid.
    pub changed: Vec<String>,
    /// Not touched, and why.
    pub refused: Vec<String>,
    /// The record could not be used.
    pub unreadable: Option<String>,
    /// An outcome file was there and was removed.
    pub outcome_file: bool,
}

impl Cleared {
    /// Paths an earlier station laid that are still there (changed since):
    /// this run may lay over them.
    pub fn replaceable(&self) -> BTreeSet<String> {
        self.changed.iter().cloned().collect()
    }

    /// The prepare step's line, if anything was there to clear.
    pub fn describe(&self) -> Option<String> {
        let mut cleared = Vec::new();
        if !self.removed.is_empty() {
            cleared.push(format!(
                "{} laid by station {}",
                files(self.removed.len()),
                self.station
            ));
        }
        if self.outcome_file {
            cleared.push("an outcome file left by an earlier agent".to_owned());
        }
        let mut parts = Vec::new();
        if !cleared.is_empty() {
            parts.push(format!("cleared {}", cleared.join(", ")));
        }
        if !self.changed.is_empty() {
            parts.push(format!(
                "left {} laid by station {} that changed since: {}",
                files(self.changed.len()),
                self.station,
                listed(&self.changed)
            ));
        }
        for refused in &self.refused {
            parts.push(format!("did not clear {refused}"));
        }
        if let Some(why) = &self.unreadable {
            parts.push(format!(
                "cannot read {LAID_FILE}, so nothing it lists was cleared: {why}"
            ));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// `1 file`, `2 files`.
fn files(n: usize) -> String {
    plural(n as u64, "file", "files")
}

fn read_record(root: &Path) -> Result<Option<LaidRecord>, String> {
    let Place::At(path) = place(root, LAID_FILE)? else {
        return Ok(None);
    };
    let meta = match fs::symlink_metadata(&path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    if !meta.is_file() {
        return Err("it is not a regular file".into());
    }
    if meta.len() > MAX_RECORD_BYTES {
        return Err(format!("it is larger than {MAX_RECORD_BYTES} bytes"));
    }
    let mut text = String::new();
    fs::File::open(&path)
        .and_then(|f| f.take(MAX_RECORD_BYTES).read_to_string(&mut text))
        .map_err(|e| e.to_string())?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| format!("it is not a record of laid files: {e}"))
}

/// Removes `path` and then its parents up to (not including) `root` while
/// they are empty.
fn remove_with_empty_parents(root: &Path, path: &Path) -> io::Result<()> {
    fs::remove_file(path)?;
    let mut dir = path.parent();
    while let Some(d) = dir {
        if d == root || !d.starts_with(root) || fs::remove_dir(d).is_err() {
            break;
        }
        dir = d.parent();
    }
    Ok(())
}

/// Clears what earlier runs left for themselves: the files `.cairn/laid.json`
/// lists (unless they changed since), the record itself, and an outcome file.
pub fn clear_leftovers(root: &Path) -> Cleared {
    let mut cleared = Cleared::default();
    let outcome_path = outcome::path_in(root);
    if let Ok(Place::At(_)) = place(root, OUTCOME_FILE)
        && let Ok(meta) = fs::symlink_metadata(&outcome_path)
    {
        let removed = if meta.is_dir() {
            fs::remove_dir_all(&outcome_path)
        } else {
            fs::remove_file(&outcome_path)
        };
        match removed {
            Ok(()) => cleared.outcome_file = true,
            Err(e) => cleared
                .refused
                .push(format!("the outcome file left by an earlier agent: {e}")),
        }
    }
    let record = match read_record(root) {
        Ok(Some(record)) => record,
        Ok(None) => return cleared,
        Err(why) => {
            cleared.unreadable = Some(why);
            return cleared;
        }
    };
    cleared.station = record.station.clone();
    for entry in &record.files {
        if let Err(e) = validate_lay_path(&entry.path) {
            cleared.refused.push(format!(
                "{:?} (named in {LAID_FILE}): {}",
                entry.path, e.reason
            ));
            continue;
        }
        let path = match place(root, &entry.path) {
            Ok(Place::At(path)) => path,
            Ok(Place::Missing) => continue,
            Err(why) => {
                cleared.refused.push(format!("{}: {why}", entry.path));
                continue;
            }
        };
        let meta = match fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                cleared.refused.push(format!("{}: {e}", entry.path));
                continue;
            }
        };
        if meta.file_type().is_symlink() {
            cleared.refused.push(format!(
                "{}: it is a symlink now, not the file station {} laid",
                entry.path, record.station
            ));
            continue;
        }
        if !meta.is_file() {
            cleared
                .refused
                .push(format!("{}: it is not a regular file now", entry.path));
            continue;
        }
        match fs::read(&path) {
            Ok(content) if sha256_hex(&content) == entry.sha256 => {
                match remove_with_empty_parents(root, &path) {
                    Ok(()) => cleared.removed.push(entry.path.clone()),
                    Err(e) => cleared.refused.push(format!("{}: {e}", entry.path)),
                }
            }
            Ok(_) => cleared.changed.push(entry.path.clone()),
            Err(e) => cleared.refused.push(format!("{}: {e}", entry.path)),
        }
    }
    if let Err(e) = fs::remove_file(root.join(LAID_FILE))
        && e.kind() != io::ErrorKind::NotFound
    {
        cleared.refused.push(format!("{LAID_FILE} itself: {e}"));
    }
    cleared
}

/// Why a run's files could not be laid (the run cannot start as asked).
#[derive(Debug, thiserror::Error)]
pub enum LayError {
    #[error("cannot lay {path}: {reason}")]
    Refused { path: String, reason: String },
    #[error("cannot lay {path}: {source}")]
    Write { path: String, source: io::Error },
    #[error("cannot record the laid files in {LAID_FILE}: {0}")]
    Record(String),
}

/// Creates the missing parents of `rel` under `root` (refusing symlinks and
/// non-directories on the way); returns the file's path.
fn make_parents(root: &Path, rel: &str) -> Result<PathBuf, LayError> {
    let refused = |reason: String| LayError::Refused {
        path: rel.to_owned(),
        reason,
    };
    loop {
        match place(root, rel).map_err(refused)? {
            Place::At(path) => return Ok(path),
            Place::Missing => {
                // Create the first missing directory, then look again.
                let mut dir = root.to_path_buf();
                let parents: Vec<&str> = rel.split('/').collect();
                for component in &parents[..parents.len() - 1] {
                    dir.push(component);
                    match fs::create_dir(&dir) {
                        Ok(()) => break,
                        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                        Err(source) => {
                            return Err(LayError::Write {
                                path: rel.to_owned(),
                                source,
                            });
                        }
                    }
                }
            }
        }
    }
}

/// Lays `files` for `station` and records them in `.cairn/laid.json`.
/// A path already taken by something no station laid is refused, except the
/// paths in `replaceable` (laid earlier and changed since). Returns the
/// prepare step's line (`None` when there is nothing to lay). The paths'
/// syntax was checked when `files` was made; what is on the disk is checked
/// here.
pub fn lay(
    root: &Path,
    station: &str,
    run_id: &str,
    files: &LaidFiles,
    replaceable: &BTreeSet<String>,
) -> Result<Option<String>, LayError> {
    if files.is_empty() {
        return Ok(None);
    }
    let mut entries = Vec::with_capacity(files.len());
    for (rel, content) in files.iter() {
        let refused = |reason: &str| LayError::Refused {
            path: rel.clone(),
            reason: reason.to_owned(),
        };
        let path = make_parents(root, rel)?;
        match fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_symlink() => return Err(refused("it is a symlink")),
            Ok(meta) if !meta.is_file() => {
                return Err(refused("something other than a file is there"));
            }
            Ok(_) if !replaceable.contains(rel) => {
                return Err(refused(
                    "the workspace already has a file there that no station laid",
                ));
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(LayError::Write {
                    path: rel.clone(),
                    source,
                });
            }
        }
        let write = || -> io::Result<()> {
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o644)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)?;
            file.write_all(content)?;
            file.sync_all()
        };
        write().map_err(|source| LayError::Write {
            path: rel.clone(),
            source,
        })?;
        entries.push(LaidEntry {
            path: rel.clone(),
            sha256: sha256_hex(content),
        });
    }
    let record = LaidRecord {
        station: station.to_owned(),
        run_id: run_id.to_owned(),
        files: entries,
    };
    let record_path = make_parents(root, LAID_FILE).map_err(|e| LayError::Record(e.to_string()))?;
    let temporary = record_path.with_extension("json.tmp");
    let json = serde_json::to_string_pretty(&record).expect("a record serialises") + "\n";
    fs::write(&temporary, json)
        .and_then(|()| fs::rename(&temporary, &record_path))
        .map_err(|e| LayError::Record(e.to_string()))?;
    let paths = files.paths();
    Ok(Some(format!(
        "laid {} for station {station}: {}",
        self::files(paths.len()),
        listed(&paths)
    )))
}

/// The files of `lay` as validated paths (the coordinator checked them
/// already; a runner checks what it receives).
pub fn received(lay: HashMap<String, Vec<u8>>) -> Result<LaidFiles, String> {
    LaidFiles::try_from(lay)
        .map_err(|e| format!("the run's files to lay are not valid: {}", e.reason))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn laid(files: &[(&str, &str)]) -> LaidFiles {
        LaidFiles::new(
            files
                .iter()
                .map(|(p, c)| ((*p).to_owned(), c.as_bytes().to_vec())),
        )
        .unwrap()
    }

    #[test]
    fn a_station_lays_its_files_and_the_next_run_clears_them() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("app")).unwrap();
        fs::write(root.join("app/keep.rs"), "mine\n").unwrap();
        let files = laid(&[
            (
                ".cairn/state/claude/skills/implement/SKILL.md",
                "# implement\n",
            ),
            ("app/.claude/settings.json", "{}\n"),
        ]);
        let line = lay(root, "implement", "run-1", &files, &BTreeSet::new())
            .unwrap()
            .unwrap();
        assert_eq!(
            line,
            "laid 2 files for station implement: .cairn/state/claude/skills/implement/SKILL.md, \
             app/.claude/settings.json"
        );
        assert_eq!(
            fs::read_to_string(root.join("app/.claude/settings.json")).unwrap(),
            "{}\n"
        );
        let record: LaidRecord =
            serde_json::from_str(&fs::read_to_string(root.join(LAID_FILE)).unwrap()).unwrap();
        assert_eq!(record.station, "implement");
        assert_eq!(record.files[1].sha256, sha256_hex(b"{}\n"));

        // A stale outcome file, and a harness state dir with other content.
        fs::write(root.join(".cairn/outcome.json"), "{\"status\":\"done\"}").unwrap();
        fs::create_dir_all(root.join(".cairn/state/claude/projects")).unwrap();
        let cleared = clear_leftovers(root);
        assert_eq!(
            cleared.describe().unwrap(),
            "cleared 2 files laid by station implement, an outcome file left by an earlier agent"
        );
        assert!(!root.join(".cairn/outcome.json").exists());
        assert!(!root.join(LAID_FILE).exists());
        assert!(
            !root.join("app/.claude").exists(),
            "emptied directories go too"
        );
        assert!(!root.join(".cairn/state/claude/skills").exists());
        assert!(root.join(".cairn/state/claude/projects").is_dir());
        assert_eq!(
            fs::read_to_string(root.join("app/keep.rs")).unwrap(),
            "mine\n"
        );

        assert_eq!(
            clear_leftovers(root).describe(),
            None,
            "nothing left to clear"
        );
    }

    #[test]
    fn changed_files_are_left_and_may_be_laid_over() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let files = laid(&[("AGENTS.md", "be brief\n"), ("notes/skill.md", "x\n")]);
        lay(root, "implement", "run-1", &files, &BTreeSet::new()).unwrap();
        fs::write(root.join("AGENTS.md"), "be brief, and tested\n").unwrap();
        fs::remove_file(root.join("notes/skill.md")).unwrap();

        let cleared = clear_leftovers(root);
        assert!(cleared.removed.is_empty(), "{cleared:?}");
        assert_eq!(cleared.changed, ["AGENTS.md"]);
        assert_eq!(
            cleared.describe().unwrap(),
            "left 1 file laid by station implement that changed since: AGENTS.md"
        );
        assert!(root.join("AGENTS.md").exists());

        // The next station lays over it; a file nobody laid is refused.
        let review = laid(&[("AGENTS.md", "review only\n")]);
        lay(root, "review", "run-2", &review, &cleared.replaceable()).unwrap();
        assert_eq!(
            fs::read_to_string(root.join("AGENTS.md")).unwrap(),
            "review only\n"
        );
        fs::write(root.join("README.md"), "project\n").unwrap();
        let err = lay(
            root,
            "review",
            "run-2",
            &laid(&[("README.md", "x")]),
            &BTreeSet::new(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot lay README.md: the workspace already has a file there that no station laid"
        );
        assert_eq!(
            fs::read_to_string(root.join("README.md")).unwrap(),
            "project\n"
        );
    }

    #[test]
    fn unsafe_paths_in_the_record_are_refused_and_nothing_outside_is_touched() {
        let base = tempfile::tempdir().unwrap();
        let root = base.path().join("workspace");
        let outside = base.path().join("outside");
        fs::create_dir_all(root.join(".cairn")).unwrap();
        fs::create_dir_all(root.join("app/.git")).unwrap();
        fs::create_dir_all(&outside).unwrap();
        fs::write(outside.join("secret"), "keep").unwrap();
        fs::write(root.join("app/.git/config"), "[core]\n").unwrap();
        symlink(&outside, root.join("link")).unwrap();
        let digest = sha256_hex(b"keep");
        let entries = [
            "../outside/secret",
            "/etc/hostname",
            "link/secret",
            "app/.git/config",
        ]
        .map(|path| LaidEntry {
            path: path.to_owned(),
            sha256: digest.clone(),
        })
        .to_vec();
        let record = LaidRecord {
            station: "implement".into(),
            run_id: "run-1".into(),
            files: entries,
        };
        fs::write(
            root.join(LAID_FILE),
            serde_json::to_string(&record).unwrap(),
        )
        .unwrap();

        let cleared = clear_leftovers(&root);
        assert!(cleared.removed.is_empty(), "{cleared:?}");
        assert_eq!(
            cleared.refused,
            [
                "\"../outside/secret\" (named in .cairn/laid.json): path \"../outside/secret\" leaves the workspace (\"..\")",
                "\"/etc/hostname\" (named in .cairn/laid.json): path \"/etc/hostname\" is absolute; paths are relative to the workspace",
                "link/secret: link is a symlink",
                "\"app/.git/config\" (named in .cairn/laid.json): path \"app/.git/config\" is inside a .git directory",
            ]
        );
        let line = cleared.describe().unwrap();
        assert!(
            line.starts_with("did not clear \"../outside/secret\""),
            "{line}"
        );
        assert_eq!(fs::read_to_string(outside.join("secret")).unwrap(), "keep");
        assert!(root.join("app/.git/config").exists());

        // A symlink where a laid file was is not followed, nor removed.
        let files = laid(&[("skill.md", "keep")]);
        lay(&root, "implement", "run-1", &files, &BTreeSet::new()).unwrap();
        fs::remove_file(root.join("skill.md")).unwrap();
        symlink(outside.join("secret"), root.join("skill.md")).unwrap();
        let cleared = clear_leftovers(&root);
        assert_eq!(
            cleared.refused,
            ["skill.md: it is a symlink now, not the file station implement laid"]
        );
        assert_eq!(fs::read_to_string(outside.join("secret")).unwrap(), "keep");

        // Laying refuses to write through a symlinked directory.
        let err = lay(
            &root,
            "review",
            "run-2",
            &laid(&[("link/new.md", "x")]),
            &BTreeSet::new(),
        )
        .unwrap_err();
        assert_eq!(err.to_string(), "cannot lay link/new.md: link is a symlink");
        assert!(!outside.join("new.md").exists());

        // A record that is not one is reported, and nothing is removed.
        fs::write(root.join(LAID_FILE), "nonsense").unwrap();
        let cleared = clear_leftovers(&root);
        assert!(
            cleared.describe().unwrap().starts_with(
                "cannot read .cairn/laid.json, so nothing it lists was cleared: it is not a record"
            ),
            "{cleared:?}"
        );
    }
}
