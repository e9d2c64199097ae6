//! A connection with its statements kept prepared: the one statement cache of this backend,
//! used by the writer's connection and the reader's alike.

use rusqlite::Connection;

/// A connection with its statements kept prepared by the address of their text
/// ([`Db::cached`]): every statement is a constant. rusqlite's own statement cache finds one
/// by hashing its whole text, copies the text into a new key at each use, and moves the
/// statement out of its LRU list and back, on the thread every durable write waits for
/// (docs/performance.md counts the difference).
pub(super) struct Db<'c> {
    pub(super) conn: &'c Connection,
    pub(super) kept: std::cell::RefCell<Vec<(&'static str, Option<rusqlite::Statement<'c>>)>>,
}

impl<'c> Db<'c> {
    pub(super) fn new(conn: &'c Connection) -> Self {
        Db {
            conn,
            kept: Default::default(),
        }
    }

    /// The statement for `sql`, prepared at its first use and kept while the writer runs.
    /// `sql` is a constant: it is known by its address. A statement in use already (one
    /// call inside another) is prepared again for the inner call; of the two, the first
    /// given back is kept and the other finalized.
    pub(super) fn cached(&self, sql: &'static str) -> rusqlite::Result<Kept<'_, 'c>> {
        let stmt = {
            let mut kept = self.kept.borrow_mut();
            match kept.iter_mut().find(|(k, _)| std::ptr::eq(*k, sql)) {
                Some((_, s)) => s.take(),
                None => {
                    kept.push((sql, None));
                    None
                }
            }
        };
        let stmt = match stmt {
            Some(s) => s,
            None => self
                .conn
                .prepare_with_flags(sql, rusqlite::PrepFlags::SQLITE_PREPARE_PERSISTENT)?,
        };
        Ok(Kept {
            db: self,
            sql,
            stmt: Some(stmt),
        })
    }

    /// Run one of the writer's statements that return no rows (BEGIN, COMMIT, ROLLBACK).
    pub(super) fn run(&self, sql: &'static str) -> rusqlite::Result<()> {
        self.cached(sql)?.execute([]).map(drop)
    }
}

impl std::ops::Deref for Db<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
    }
}

/// A statement of [`Db::cached`], given back to it when dropped. rusqlite resets a
/// statement after each `execute` and when the rows of a query are dropped, and every use
/// binds all its parameters: nothing of one use is left for the next.
pub(super) struct Kept<'d, 'c> {
    pub(super) db: &'d Db<'c>,
    pub(super) sql: &'static str,
    pub(super) stmt: Option<rusqlite::Statement<'c>>,
}

impl<'c> std::ops::Deref for Kept<'_, 'c> {
    type Target = rusqlite::Statement<'c>;

    fn deref(&self) -> &Self::Target {
        self.stmt.as_ref().expect("a kept statement until dropped")
    }
}

impl std::ops::DerefMut for Kept<'_, '_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.stmt.as_mut().expect("a kept statement until dropped")
    }
}

impl Drop for Kept<'_, '_> {
    fn drop(&mut self) {
        let mut kept = self.db.kept.borrow_mut();
        if let Some((_, slot @ None)) = kept.iter_mut().find(|(k, _)| std::ptr::eq(*k, self.sql)) {
            *slot = self.stmt.take();
        }
    }
}
