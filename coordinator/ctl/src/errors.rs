//! Errors that say what happened and what to do next.
//!
//! A failure is told apart by what it is, never by the words of a message
//! (the coordinator may reword those at any time): the typed refusal a
//! status carries ([`Refusal`]), else the gRPC status code, and for a
//! connection that failed, the kind of I/O error or the TLS error under it.
//! The cause is printed as `error: …`, as before; the next step, when
//! cairnctl knows one, follows on a line of its own as `hint: …`.

use std::fmt;

use cairn_engine::client::ConnectError;
use cairn_engine::restore::describe_status;
use cairn_proto::refusal::{Refusal, TokenRefusal};
use tonic::Code;

/// A refused call: what cairnctl was doing, and the coordinator's status.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {}", describe_status(.status))]
pub struct RpcError {
    pub what: &'static str,
    pub status: tonic::Status,
}

/// What the advice may point to: where cairnctl was talking to, whether a
/// token was given, and the command that lists what the failed command
/// names (for "not found").
#[derive(Debug, Clone)]
pub struct Circumstances {
    pub coordinator: String,
    pub token_given: bool,
    pub listing: Option<&'static str>,
}

/// An error with, when known, the next step.
#[derive(Debug)]
pub struct Explained {
    cause: String,
    hint: Option<String>,
}

impl Explained {
    /// What to do next, if cairnctl knows.
    pub fn hint(&self) -> Option<&str> {
        self.hint.as_deref()
    }
}

impl fmt::Display for Explained {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.cause)?;
        if let Some(hint) = self.hint() {
            write!(f, "\nhint: {hint}")?;
        }
        Ok(())
    }
}

/// The cause and the hint are all it says: the chain is in the cause.
impl std::error::Error for Explained {}

/// `error` with the cause restated where cairnctl can say it better, and
/// the next step where it knows one.
pub fn explain(error: &anyhow::Error, circumstances: &Circumstances) -> Explained {
    let whole = cairn_utils::text::one_line(error.as_ref());
    if let Some(connect) = error.chain().find_map(|e| e.downcast_ref::<ConnectError>()) {
        let (cause, hint) = connect_advice(connect);
        return Explained {
            cause: cause.unwrap_or(whole),
            hint,
        };
    }
    let status = error.chain().find_map(|e| {
        e.downcast_ref::<RpcError>()
            .map(|r| &r.status)
            .or_else(|| e.downcast_ref::<tonic::Status>())
    });
    Explained {
        cause: whole,
        hint: status.and_then(|s| status_advice(s, circumstances)),
    }
}

const WHERE_TO_POINT: &str = "point cairnctl at it with --coordinator or CAIRN_COORDINATOR";
const WHICH_TOKEN: &str = "set --token or CAIRN_TOKEN (the admin token is in the coordinator's DATA_DIR/admin.token; `cairnctl tokens create` makes others)";

/// A restated cause (when the error's own words can be bettered) and the
/// next step, for a connection that could not be made.
fn connect_advice(error: &ConnectError) -> (Option<String>, Option<String>) {
    match error {
        ConnectError::BadAddress(_) => (
            None,
            Some(format!(
                "give an address like http://127.0.0.1:7400 (https:// for TLS); {WHERE_TO_POINT}"
            )),
        ),
        ConnectError::Unreachable { address, cause } => unreachable_advice(address, cause),
        ConnectError::BadTlsSettings { .. } | ConnectError::Tls(_) => (
            None,
            Some("CAIRN_CA must name a PEM file (or hold PEM text) with the CA certificate that signed the coordinator's".into()),
        ),
        ConnectError::BadToken(_) => (
            None,
            Some(format!(
                "the token is not one the coordinator could have made; {WHICH_TOKEN}"
            )),
        ),
    }
}

/// What lies under a failed connection: refused, timed out, no such host,
/// or a TLS handshake that failed.
fn unreachable_advice(
    address: &str,
    cause: &tonic::transport::Error,
) -> (Option<String>, Option<String>) {
    if let Some(tls) = tls_error_under(cause) {
        let hint = match tls {
            rustls::Error::InvalidCertificate(_) => {
                "set CAIRN_CA to the CA bundle (PEM) that signed the coordinator's certificate"
                    .to_owned()
            }
            _ => "check that the coordinator serves TLS there: https:// (with CAIRN_CA) for a coordinator started with --tls-cert, http:// for one without".to_owned(),
        };
        return (
            Some(format!(
                "the TLS handshake with the coordinator at {address} failed: {tls}"
            )),
            Some(hint),
        );
    }
    let Some(io) = io_error_under(cause) else {
        return (
            None,
            Some(format!(
                "is cairn-coordinator running at {address}? {WHERE_TO_POINT}"
            )),
        );
    };
    use std::io::ErrorKind;
    let (what, hint) = match io.kind() {
        ErrorKind::ConnectionRefused => (
            "connection refused",
            format!("is cairn-coordinator running and listening there? {WHERE_TO_POINT}"),
        ),
        ErrorKind::TimedOut => (
            "timed out",
            format!("is the address right and the port open to this machine? {WHERE_TO_POINT}"),
        ),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::UnexpectedEof => (
            "the connection was closed",
            "is it a cairn coordinator's gRPC port (--listen), and does it serve TLS (then use https:// and CAIRN_CA)?".to_owned(),
        ),
        ErrorKind::NotFound | ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable => (
            "no route to it",
            format!("check the host name in the address; {WHERE_TO_POINT}"),
        ),
        _ => {
            return (
                None,
                Some(format!(
                    "is cairn-coordinator running at {address}? {WHERE_TO_POINT}"
                )),
            );
        }
    };
    (
        Some(format!("cannot reach the coordinator at {address}: {what}")),
        Some(hint),
    )
}

/// The errors under `error`, outermost first. An `io::Error` made from
/// another error reports that one's source as its own, not the error
/// itself, so the error it wraps is visited too.
fn causes<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    let mut next = Some(error);
    let mut wrapped: Option<&'a (dyn std::error::Error + 'static)> = None;
    std::iter::from_fn(move || {
        if let Some(inner) = wrapped.take() {
            return Some(inner);
        }
        let current = next?;
        next = current.source();
        if let Some(io) = current.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
        {
            wrapped = Some(inner as &(dyn std::error::Error + 'static));
        }
        Some(current)
    })
}

fn tls_error_under(error: &tonic::transport::Error) -> Option<&rustls::Error> {
    causes(error).find_map(|e| e.downcast_ref::<rustls::Error>())
}

fn io_error_under(error: &tonic::transport::Error) -> Option<&std::io::Error> {
    causes(error).find_map(|e| e.downcast_ref::<std::io::Error>())
}

/// The next step after a refused call, from its typed refusal, else its code.
fn status_advice(status: &tonic::Status, circumstances: &Circumstances) -> Option<String> {
    if let Some(refusal) = Refusal::of(status) {
        return refusal_advice(&refusal);
    }
    let address = &circumstances.coordinator;
    Some(match status.code() {
        Code::Unauthenticated if !circumstances.token_given => {
            format!("no token was given: {WHICH_TOKEN}")
        }
        Code::Unauthenticated => format!("the coordinator did not take the token: {WHICH_TOKEN}"),
        Code::PermissionDenied => format!(
            "the coordinator does not know this token, or its scope does not allow this (hosts, tokens, gc and storage need the admin token): {WHICH_TOKEN}"
        ),
        Code::NotFound => match circumstances.listing {
            Some(listing) => format!("check the id or name: `{listing}` shows those there are"),
            None => "check the id or name".to_owned(),
        },
        Code::AlreadyExists => "choose another name".to_owned(),
        Code::Unavailable => format!(
            "the coordinator at {address} did not answer: is it still running? Try again once it is back"
        ),
        Code::DeadlineExceeded => {
            "the coordinator took too long; try again, and see its log if it persists".to_owned()
        }
        Code::ResourceExhausted => {
            "the coordinator is at one of its limits; wait a little and try again".to_owned()
        }
        Code::Unimplemented => format!(
            "the coordinator at {address} does not have this call: it is older than this cairnctl; upgrade it"
        ),
        Code::Internal | Code::Unknown | Code::DataLoss => {
            "the coordinator's log says more about the cause".to_owned()
        }
        _ => return None,
    })
}

fn refusal_advice(refusal: &Refusal) -> Option<String> {
    Some(match refusal {
        Refusal::Token(why) => {
            let what = match why {
                TokenRefusal::Expired => "expired",
                TokenRefusal::Revoked => "was revoked",
            };
            format!(
                "the token {what}: ask an admin for a new one (`cairnctl tokens create --scope client`) and set --token or CAIRN_TOKEN"
            )
        }
        Refusal::WorkspaceHasRuns { runs, .. } => {
            let first = runs.first().map_or("RUN", |r| r.as_str());
            format!(
                "cancel its runs first (`cairnctl runs cancel {first}`), or wait until they end"
            )
        }
        Refusal::WorkspaceNotActive { state, .. } => format!(
            "a {state} workspace takes no new work; `cairnctl checkout` still restores its checkpoints, or start anew with `cairnctl runs create --new-workspace`"
        ),
        Refusal::LimitExceeded { limit, max, .. } => format!(
            "the coordinator allows at most {max} for {limit}: ask for less, or raise that limit where the coordinator is configured"
        ),
        Refusal::StaleGeneration { .. } | Refusal::AttemptNotCurrent { .. } => {
            "another attempt took over the workspace; `cairnctl runs list` shows the current one"
                .to_owned()
        }
        Refusal::PacksMissing { .. } => {
            "`cairnctl verify WS` says which checkpoints are affected".to_owned()
        }
        Refusal::ClientCertificateRequired => {
            "this coordinator takes host calls only with a client certificate of its CA (mutual TLS)"
                .to_owned()
        }
        Refusal::WrongHost { .. } => return None,
    })
}

#[cfg(test)]
mod tests {
    use cairn_proto::ids::{RunId, WorkspaceId};

    use super::*;

    fn circumstances(token_given: bool) -> Circumstances {
        Circumstances {
            coordinator: "http://127.0.0.1:7400".into(),
            token_given,
            listing: Some("cairnctl runs list"),
        }
    }

    fn refused(status: tonic::Status, token_given: bool) -> Explained {
        let error = anyhow::Error::new(RpcError {
            what: "showing the run",
            status,
        });
        explain(&error, &circumstances(token_given))
    }

    #[test]
    fn a_typed_refusal_decides_the_hint_not_the_message() {
        let expired = Refusal::Token(TokenRefusal::Expired).into_status("whatever words");
        let explained = refused(expired, true);
        assert!(
            explained.to_string().starts_with("showing the run: "),
            "the cause comes first: {explained}"
        );
        assert!(
            explained.hint().unwrap().contains("the token expired"),
            "{explained}"
        );
        // The same words without the typed refusal are only a permission denied.
        let plain = tonic::Status::permission_denied("the bearer token is expired");
        let hint = refused(plain, true).hint().unwrap().to_owned();
        assert!(!hint.contains("expired"), "{hint}");
        assert!(hint.contains("CAIRN_TOKEN"), "{hint}");
    }

    #[test]
    fn a_missing_token_and_an_unknown_name_say_what_to_do() {
        let missing = refused(tonic::Status::unauthenticated("x"), false);
        assert!(
            missing
                .hint()
                .unwrap()
                .starts_with("no token was given: set --token or CAIRN_TOKEN"),
            "{missing}"
        );
        let unknown = refused(tonic::Status::not_found("x"), true);
        assert!(
            unknown.hint().unwrap().contains("`cairnctl runs list`"),
            "{unknown}"
        );
        let busy = Refusal::WorkspaceHasRuns {
            workspace: WorkspaceId::generate(),
            runs: vec![RunId::generate()],
        }
        .into_status("x");
        assert!(
            refused(busy, true)
                .hint()
                .unwrap()
                .contains("cairnctl runs cancel run-"),
        );
        let invalid = refused(tonic::Status::invalid_argument("bad name"), true);
        assert_eq!(invalid.hint(), None, "the message says it all");
        assert_eq!(
            invalid.to_string(),
            "showing the run: invalid argument: bad name"
        );
    }

    #[tokio::test]
    async fn a_refused_connection_names_the_address_and_how_to_change_it() {
        // Port 1 on the loopback: nothing listens there.
        let address = "http://127.0.0.1:1";
        let error = cairn_engine::client::CoordinatorClient::connect(address, None)
            .await
            .expect_err("nothing listens on port 1");
        let explained = explain(&error.into(), &circumstances(true));
        assert_eq!(
            explained.to_string().lines().next().unwrap(),
            "cannot reach the coordinator at http://127.0.0.1:1: connection refused"
        );
        assert!(
            explained
                .hint()
                .unwrap()
                .contains("--coordinator or CAIRN_COORDINATOR"),
            "{explained}"
        );
    }
}
