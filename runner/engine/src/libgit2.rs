//! Process-wide libgit2 settings. Its own module because both the walk
//! ([`crate::scan`], for git's ignore rules) and [`crate::git`] open
//! repositories, and the walk sits below git.

use std::sync::Once;

/// Process-wide libgit2 settings, applied once before any repository is opened.
pub fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        // A restored workspace may be owned by another uid than the runner's.
        // libgit2's ownership check guards against running hooks or filters
        // from a foreign config; this module only reads refs, the index and
        // the working tree, so the check would only lose metadata.
        // SAFETY: called once, before any other libgit2 call of this process
        // (every caller goes through this function first).
        if let Err(e) = unsafe { git2::opts::set_verify_owner_validation(false) } {
            tracing::debug!(error = %e, "cannot turn off libgit2's owner validation");
        }
        // Hashing every object read again, to check it against its id,
        // makes reading the state of a large repository several times
        // slower; git itself does not do it on reads either.
        git2::opts::strict_hash_verification(false);
    });
}
