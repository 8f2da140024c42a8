//! Where the metadata lives: a SQLite file or a PostgreSQL database.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// Longest schema name PostgreSQL keeps (NAMEDATALEN - 1).
pub(super) const MAX_SCHEMA_LEN: usize = 63;

/// The metadata database a coordinator opens.
#[derive(Clone, PartialEq, Eq)]
pub enum DatabaseLocation {
    /// A SQLite file, created when missing (the embedded default,
    /// `DIR/cairn.db`).
    Sqlite(PathBuf),
    /// A PostgreSQL database.
    Postgres {
        /// `postgres://user:password@host:port/database?…` (libpq's URL
        /// form, as sqlx reads it).
        url: String,
        /// The schema cairn's tables live in, created when missing;
        /// `None` uses the connection's default search path (`public`).
        schema: Option<String>,
    },
}

impl DatabaseLocation {
    /// The embedded database of a data directory.
    pub fn sqlite(path: impl Into<PathBuf>) -> Self {
        Self::Sqlite(path.into())
    }

    /// `location` in a schema of its own (PostgreSQL only; SQLite files are
    /// their own namespace). Refuses a name that is not a plain identifier.
    pub fn in_schema(self, schema: &str) -> Result<Self, super::DbError> {
        match self {
            Self::Sqlite(_) => Err(super::DbError::BadLocation(
                "a schema applies to PostgreSQL only; a SQLite file holds one coordinator's metadata".into(),
            )),
            Self::Postgres { url, .. } => {
                check_schema(schema)?;
                Ok(Self::Postgres {
                    url,
                    schema: Some(schema.to_owned()),
                })
            }
        }
    }

    /// A URL sqlx's `Any` driver opens this database with (in its schema,
    /// for PostgreSQL), for tools and tests that read the metadata directly.
    pub fn sqlx_url(&self) -> String {
        match self {
            Self::Sqlite(path) => {
                let mut url = String::from("sqlite://");
                for c in path.to_string_lossy().chars() {
                    // The characters the URL form gives a meaning.
                    match c {
                        '%' => url.push_str("%25"),
                        '?' => url.push_str("%3F"),
                        '#' => url.push_str("%23"),
                        c => url.push(c),
                    }
                }
                url.push_str("?mode=rwc");
                url
            }
            Self::Postgres { url, schema: None } => url.clone(),
            Self::Postgres {
                url,
                schema: Some(schema),
            } => {
                // A startup option: every connection starts in the schema.
                let separator = if url.contains('?') { '&' } else { '?' };
                format!("{url}{separator}options=-c%20search_path%3D{schema}")
            }
        }
    }
}

fn check_schema(schema: &str) -> Result<(), super::DbError> {
    let plain = !schema.is_empty()
        && schema.len() <= MAX_SCHEMA_LEN
        && schema.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if plain {
        Ok(())
    } else {
        Err(super::DbError::BadLocation(format!(
            "schema {schema:?} is not a plain identifier: up to {MAX_SCHEMA_LEN} of [a-z0-9_], not starting with a digit"
        )))
    }
}

impl FromStr for DatabaseLocation {
    type Err = super::DbError;

    /// `postgres://…` or `postgresql://…` for PostgreSQL; `sqlite://PATH`
    /// or a bare path for a SQLite file.
    fn from_str(value: &str) -> Result<Self, Self::Err> {
        if value.starts_with("postgres://") || value.starts_with("postgresql://") {
            // Refuse what sqlx would refuse later, now, and with the reason.
            value
                .parse::<sqlx::postgres::PgConnectOptions>()
                .map_err(|e| {
                    super::DbError::BadLocation(format!(
                        "{} is not a PostgreSQL URL sqlx can use: {e}",
                        redact(value)
                    ))
                })?;
            return Ok(Self::Postgres {
                url: value.to_owned(),
                schema: None,
            });
        }
        if let Some(path) = value.strip_prefix("sqlite://") {
            if path.is_empty() {
                return Err(super::DbError::BadLocation(
                    "sqlite:// needs a file path, as in sqlite:///var/lib/cairn/cairn.db".into(),
                ));
            }
            return Ok(Self::Sqlite(PathBuf::from(path)));
        }
        if value.contains("://") {
            let scheme = value.split("://").next().unwrap_or_default();
            return Err(super::DbError::BadLocation(format!(
                "database scheme {scheme:?} is not supported: use postgres://… or a SQLite file path"
            )));
        }
        if value.is_empty() {
            return Err(super::DbError::BadLocation(
                "the database location is empty".into(),
            ));
        }
        Ok(Self::Sqlite(PathBuf::from(value)))
    }
}

/// `url` with its password replaced, for logs and errors.
pub(super) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let authority = match authority.rsplit_once('@') {
        Some((user_info, host)) => match user_info.split_once(':') {
            Some((user, _)) => format!("{user}:***@{host}"),
            None => authority.to_owned(),
        },
        None => authority.to_owned(),
    };
    // A password may also come as a query parameter.
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if key.eq_ignore_ascii_case("password") => {
                        format!("{key}=***")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

impl fmt::Display for DatabaseLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sqlite(path) => write!(f, "{}", path.display()),
            Self::Postgres { url, schema: None } => f.write_str(&redact(url)),
            Self::Postgres {
                url,
                schema: Some(schema),
            } => write!(f, "{} (schema {schema})", redact(url)),
        }
    }
}

impl fmt::Debug for DatabaseLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL may hold a password: show what Display shows.
        write!(f, "DatabaseLocation({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse_by_scheme_and_bad_ones_say_why() {
        assert_eq!(
            "/var/lib/cairn/cairn.db"
                .parse::<DatabaseLocation>()
                .unwrap(),
            DatabaseLocation::Sqlite("/var/lib/cairn/cairn.db".into())
        );
        assert_eq!(
            "sqlite:///x/cairn.db".parse::<DatabaseLocation>().unwrap(),
            DatabaseLocation::Sqlite("/x/cairn.db".into())
        );
        assert!(matches!(
            "postgres://cairn@db:5432/cairn".parse::<DatabaseLocation>(),
            Ok(DatabaseLocation::Postgres { schema: None, .. })
        ));
        for (bad, says) in [
            ("mysql://db/cairn", "\"mysql\" is not supported"),
            ("sqlite://", "needs a file path"),
            ("", "is empty"),
        ] {
            let err = bad.parse::<DatabaseLocation>().unwrap_err().to_string();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }

    #[test]
    fn passwords_never_show() {
        let location: DatabaseLocation = "postgres://cairn:s3cret@db:5432/cairn?sslmode=require"
            .parse()
            .unwrap();
        let shown = format!("{location} {location:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(
            shown.contains("cairn:***@db:5432/cairn?sslmode=require"),
            "{shown}"
        );
        assert_eq!(
            redact("postgres://db/cairn?user=u&password=p"),
            "postgres://db/cairn?user=u&password=***"
        );
    }

    #[test]
    fn schemas_are_plain_identifiers_and_postgres_only() {
        let pg: DatabaseLocation = "postgres://db/cairn".parse().unwrap();
        assert!(pg.clone().in_schema("cairn_prod").is_ok());
        for bad in ["", "Prod", "1st", "a-b", "a;drop", &"x".repeat(64)] {
            assert!(pg.clone().in_schema(bad).is_err(), "{bad:?}");
        }
        assert!(DatabaseLocation::sqlite("/x").in_schema("a").is_err());
    }
}
