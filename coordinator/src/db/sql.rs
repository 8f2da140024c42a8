//! A statement built piece by piece with numbered parameters.
//!
//! sqlx's `QueryBuilder` asks the driver how to write a placeholder, and the
//! `Any` driver answers `?`, which PostgreSQL does not read. [`SqlBuilder`]
//! writes `$1, $2, …`, which both databases read, with the subset of
//! `QueryBuilder`'s interface the queries here use.

use std::fmt::Write as _;

use sqlx::any::AnyArguments;
use sqlx::query::{Query, QueryScalar};
use sqlx::{Any, Arguments, Encode, Type};

/// A statement and the values bound to its parameters so far.
pub(crate) struct SqlBuilder<'args> {
    sql: String,
    arguments: Option<AnyArguments<'args>>,
    count: usize,
}

impl<'args> SqlBuilder<'args> {
    pub(crate) fn new(init: impl Into<String>) -> Self {
        Self {
            sql: init.into(),
            arguments: Some(AnyArguments::default()),
            count: 0,
        }
    }

    /// Appends SQL text as it is (never a value: values are bound).
    pub(crate) fn push(&mut self, sql: impl std::fmt::Display) -> &mut Self {
        write!(self.sql, "{sql}").expect("writing to a String cannot fail");
        self
    }

    /// Binds `value` to the next parameter and appends its placeholder.
    pub(crate) fn push_bind<T>(&mut self, value: T) -> &mut Self
    where
        T: 'args + Encode<'args, Any> + Type<Any>,
    {
        let arguments = self
            .arguments
            .as_mut()
            .expect("a SqlBuilder is not used after build");
        // Encoding into the Any driver's buffer only records the value; the
        // error a driver reports comes when the statement runs.
        if let Err(e) = arguments.add(value) {
            tracing::error!(error = %e, "a value could not be bound");
        }
        self.count += 1;
        write!(self.sql, "${}", self.count).expect("writing to a String cannot fail");
        self
    }

    /// A list whose items are joined by `separator`.
    pub(crate) fn separated<'b>(&'b mut self, separator: &'static str) -> Separated<'b, 'args> {
        Separated {
            builder: self,
            separator,
            first: true,
        }
    }

    /// Appends ` VALUES (…), (…)`, one tuple per item, filled by `push_tuple`.
    pub(crate) fn push_values<I, F>(&mut self, tuples: I, mut push_tuple: F) -> &mut Self
    where
        I: IntoIterator,
        F: FnMut(Separated<'_, 'args>, I::Item),
    {
        self.push(" VALUES ");
        for (i, tuple) in tuples.into_iter().enumerate() {
            if i > 0 {
                self.push(", ");
            }
            self.push("(");
            push_tuple(self.separated(", "), tuple);
            self.push(")");
        }
        self
    }

    /// The statement, ready to run.
    pub(crate) fn build<'s>(&'s mut self) -> Query<'s, Any, AnyArguments<'s>>
    where
        'args: 's,
    {
        let arguments = self.arguments.take().expect("a SqlBuilder is built once");
        sqlx::query_with(&self.sql, arguments)
    }

    /// The statement, reading one column of each row as `O`.
    pub(crate) fn build_query_scalar<'s, O>(
        &'s mut self,
    ) -> QueryScalar<'s, Any, O, AnyArguments<'s>>
    where
        'args: 's,
        (O,): for<'r> sqlx::FromRow<'r, sqlx::any::AnyRow>,
    {
        let arguments = self.arguments.take().expect("a SqlBuilder is built once");
        sqlx::query_scalar_with(&self.sql, arguments)
    }

    #[cfg(test)]
    fn sql(&self) -> &str {
        &self.sql
    }
}

/// Items of a list, joined by a separator (see [`SqlBuilder::separated`]).
pub(crate) struct Separated<'b, 'args> {
    builder: &'b mut SqlBuilder<'args>,
    separator: &'static str,
    first: bool,
}

impl<'args> Separated<'_, 'args> {
    fn separate(&mut self) {
        if !self.first {
            self.builder.push(self.separator);
        }
        self.first = false;
    }

    /// Binds `value` as the next item.
    pub(crate) fn push_bind<T>(&mut self, value: T) -> &mut Self
    where
        T: 'args + Encode<'args, Any> + Type<Any>,
    {
        self.separate();
        self.builder.push_bind(value);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_numbered_in_the_order_they_are_bound() {
        let mut query = SqlBuilder::new("SELECT id FROM packs WHERE tenant = ");
        query.push_bind("acme").push(" AND id IN (");
        let mut list = query.separated(", ");
        for id in ["a", "b"] {
            list.push_bind(id);
        }
        query.push(")");
        assert_eq!(
            query.sql(),
            "SELECT id FROM packs WHERE tenant = $1 AND id IN ($2, $3)"
        );
        let mut insert = SqlBuilder::new("INSERT INTO t (a, b)");
        insert.push_values([(1_i64, 2_i64), (3, 4)], |mut row, (a, b)| {
            row.push_bind(a).push_bind(b);
        });
        assert_eq!(
            insert.sql(),
            "INSERT INTO t (a, b) VALUES ($1, $2), ($3, $4)"
        );
    }
}
