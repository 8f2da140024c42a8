//! `cairnctl tokens create|list|revoke` (admin token).
//!
//! A host token created here is an enrollment token: `cairn-host` registers
//! a new host with it and from then on uses the token bound to that host,
//! which the coordinator answered with and the host keeps in its data dir.

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use cairn_engine::client::CoordinatorClient;
use cairn_proto::pb;
use clap::ValueEnum;
use serde_json::{Value, json};

use super::output::{self, time_of};
use super::{Output, emit, hosts, print_document, rpc_error};

/// Scopes an admin can hand out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scope {
    /// Workspaces, checkpoints and runs.
    Client,
    /// For `cairn-host`: an enrollment token, which registers a new host
    /// (the host then uses the token bound to it).
    Host,
}

impl Scope {
    fn as_str(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Host => "host",
        }
    }
}

/// Parses `--expires-in` (`30d`, `12h`, `90m`): a positive duration.
pub fn parse_expires_in(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text.trim())
        .map_err(|e| format!("{text:?} is not a duration like 30d, 12h or 90m: {e}"))?;
    if d.is_zero() {
        return Err("a token that expires at once is of no use; leave --expires-in out for one that never expires".into());
    }
    Ok(d)
}

/// Prints the new token alone on stdout (so `$(cairnctl tokens create …)`
/// works); it is shown only this once.
pub async fn create(
    coordinator: &CoordinatorClient,
    scope: Scope,
    description: Option<String>,
    expires_in: Option<Duration>,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let created = hosts::client(coordinator)
        .create_token(pb::CreateTokenRequest {
            scope: scope.as_str().to_owned(),
            description: description.unwrap_or_default(),
            expires_in: expires_in.map(cairn_proto::runs::to_proto_duration),
        })
        .await
        .map_err(rpc_error("creating the token"))?
        .into_inner();
    let expires_at = time_of!(created.expires_at);
    match out {
        Output::Json | Output::Yaml => print_document(
            out,
            &json!({
                "token": created.token,
                "id": created.id,
                "scope": created.scope,
                "expires_at": output::rfc3339(expires_at),
            }),
        )?,
        Output::Table | Output::Wide => {
            eprintln!(
                "{} token {} created{}; it is shown only now and cannot be read back",
                created.scope,
                created.id,
                match expires_at {
                    Some(at) => format!(", expires {}", humantime::format_rfc3339_seconds(at)),
                    None => String::new(),
                }
            );
            emit(&created.token)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn list(coordinator: &CoordinatorClient, out: Output) -> anyhow::Result<ExitCode> {
    let tokens = hosts::client(coordinator)
        .list_tokens(pb::ListTokensRequest {})
        .await
        .map_err(rpc_error("listing tokens"))?
        .into_inner()
        .tokens;
    match out {
        Output::Json | Output::Yaml => {
            print_document(out, &Value::Array(tokens.iter().map(token_json).collect()))?
        }
        Output::Table | Output::Wide => {
            emit(&tokens_table(&tokens, SystemTime::now(), out.is_wide()))?
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn revoke(
    coordinator: &CoordinatorClient,
    id: &str,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let revoked = hosts::client(coordinator)
        .revoke_token(pb::RevokeTokenRequest { id: id.to_owned() })
        .await
        .map_err(rpc_error("revoking the token"))?
        .into_inner();
    match out {
        Output::Json | Output::Yaml => print_document(out, &token_json(&revoked))?,
        Output::Table | Output::Wide => emit(&format!(
            "token {} ({}) revoked: it is refused from now on",
            revoked.id, revoked.scope
        ))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// What a host token is: bound to a host, or an enrollment token.
fn kind(t: &pb::TokenInfo) -> String {
    match (t.scope.as_str(), t.host_id.as_str()) {
        ("host", "") => "host (enrollment)".into(),
        ("host", _) => "host (bound)".into(),
        (scope, _) => scope.into(),
    }
}

/// Whether the token is honoured at `now`, in a word.
fn status(t: &pb::TokenInfo, now: SystemTime) -> &'static str {
    if t.revoked_at.is_some() {
        "revoked"
    } else if time_of!(t.expires_at).is_some_and(|at| at <= now) {
        "expired"
    } else {
        "valid"
    }
}

fn token_json(t: &pb::TokenInfo) -> Value {
    json!({
        "id": t.id,
        "scope": t.scope,
        "description": t.description,
        "created_at": output::rfc3339(time_of!(t.created_at)),
        "expires_at": output::rfc3339(time_of!(t.expires_at)),
        "revoked_at": output::rfc3339(time_of!(t.revoked_at)),
        "host_id": if t.host_id.is_empty() { Value::Null } else { Value::String(t.host_id.clone()) },
        "status": status(t, SystemTime::now()),
    })
}

/// One row per token: kind, status, times, bound host, description (`wide`:
/// the whole description, and exact creation and revocation times).
pub fn tokens_table(tokens: &[pb::TokenInfo], now: SystemTime, wide: bool) -> String {
    let time = |t: Option<SystemTime>| {
        if wide {
            t.map_or_else(
                || "-".to_owned(),
                |t| humantime::format_rfc3339_seconds(t).to_string(),
            )
        } else {
            output::age(t)
        }
    };
    let rows: Vec<Vec<String>> = tokens
        .iter()
        .map(|t| {
            vec![
                t.id.clone(),
                kind(t),
                status(t, now).to_owned(),
                time(time_of!(t.created_at)),
                time_of!(t.expires_at).map_or_else(
                    || "never".to_owned(),
                    |at| humantime::format_rfc3339_seconds(at).to_string(),
                ),
                time(time_of!(t.revoked_at)),
                output::or_dash(&t.host_id),
                if wide {
                    output::or_dash(&t.description.replace('\n', " "))
                } else {
                    output::first_line(&t.description, 60)
                },
            ]
        })
        .collect();
    output::table(
        &[
            "ID",
            "SCOPE",
            "STATUS",
            "CREATED",
            "EXPIRES",
            "REVOKED",
            "HOST",
            "DESCRIPTION",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use cairn_proto::domain::to_timestamp;

    use super::*;

    #[test]
    fn expiries_parse_as_positive_durations() {
        assert_eq!(
            parse_expires_in("30d").unwrap(),
            Duration::from_secs(30 * 86400)
        );
        assert_eq!(parse_expires_in("90m").unwrap(), Duration::from_secs(5400));
        assert!(parse_expires_in("0s").is_err());
        assert!(parse_expires_in("soon").unwrap_err().contains("soon"));
    }

    #[test]
    fn the_table_says_what_each_token_is_and_whether_it_works() {
        let now = SystemTime::now();
        let hour = Duration::from_secs(3600);
        let token = |id: &str, scope: &str, host: &str| pb::TokenInfo {
            id: id.into(),
            scope: scope.into(),
            description: format!("{id} note"),
            created_at: Some(to_timestamp(now - hour)),
            host_id: host.into(),
            ..Default::default()
        };
        let enrollment = token("tok-a", "host", "");
        let bound = token("tok-b", "host", "host-x");
        let expired = pb::TokenInfo {
            expires_at: Some(to_timestamp(now - Duration::from_secs(1))),
            ..token("tok-c", "client", "")
        };
        let revoked = pb::TokenInfo {
            revoked_at: Some(to_timestamp(now)),
            ..token("tok-d", "client", "")
        };
        let table = tokens_table(&[enrollment, bound, expired, revoked], now, false);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("ID"), "{table}");
        assert!(lines[1].contains("host (enrollment)") && lines[1].contains("valid"));
        assert!(lines[1].contains("never"), "{table}");
        assert!(lines[2].contains("host (bound)") && lines[2].contains("host-x"));
        assert!(lines[3].contains("expired"), "{table}");
        assert!(lines[4].contains("revoked"), "{table}");
    }
}
