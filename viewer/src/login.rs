//! The browser login of a keyed viewer: a form posts the admin key once, and the answer sets
//! a cookie that stands for it. The cookie is not the key: it is a random token made when
//! the server starts, kept in memory only (a restart logs every browser out), so a cookie
//! that leaks does not leak the key, and nothing on disk can be replayed. Both the key and
//! the token are compared in constant time. `Authorization: Bearer <key>` keeps working
//! beside it (scripts, curl).
//!
//! The server owns the listener and the routes (`graft view` answers `POST /login` with
//! [`Login::form`] and [`Login::set_cookie`]); the login page itself is
//! [`crate::Viewer::login_page`].

use rand::Rng;
use subtle::ConstantTimeEq;

/// The cookie's name.
pub const COOKIE: &str = "graft_view";

/// The largest login form body a server should read (the key and where to go next).
pub const MAX_FORM_BYTES: usize = 16 * 1024;

/// The admin key and the session token that stands for it in a browser.
pub struct Login {
    key: String,
    token: String,
}

/// A login form as posted: the key typed, and the page to go back to.
#[derive(Debug, PartialEq)]
pub struct Form {
    pub key: Option<String>,
    pub next: String,
}

fn same(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

impl Login {
    /// A login for `key`, with a fresh random token (32 bytes from the OS-seeded CSPRNG).
    pub fn new(key: &str) -> Login {
        let bytes: [u8; 32] = rand::rng().random();
        let token = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Login {
            key: key.to_owned(),
            token,
        }
    }

    /// Whether `sent` is the admin key (constant time).
    pub fn key_matches(&self, sent: &str) -> bool {
        same(sent, &self.key)
    }

    /// Whether a `Cookie` header carries this login's token.
    pub fn cookie_matches(&self, cookie_header: &str) -> bool {
        cookie_header
            .split(';')
            .filter_map(|pair| pair.trim().split_once('='))
            .any(|(name, value)| name.trim() == COOKIE && same(value.trim(), &self.token))
    }

    /// The `Set-Cookie` value a successful login answers with: `HttpOnly` (no script reads
    /// it), `SameSite=Strict` (no other site's page sends it), `Path=/`. Not `Secure`:
    /// `graft view` serves plain HTTP, and a browser would not send a Secure cookie back
    /// over it beyond loopback (put a TLS proxy in front for a network you do not trust).
    pub fn set_cookie(&self) -> String {
        format!("{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/", self.token)
    }

    /// Parses a posted form (`application/x-www-form-urlencoded`: `key`, `next`).
    pub fn form(body: &[u8]) -> Form {
        let mut key = None;
        let mut next = String::new();
        for (k, v) in form_urlencoded::parse(body) {
            match &*k {
                "key" => key = Some(v.trim().to_owned()).filter(|k| !k.is_empty()),
                "next" => next = v.into_owned(),
                _ => {}
            }
        }
        Form {
            key,
            next: safe_next(&next),
        }
    }
}

/// Where a login may send the browser next: a path of this server ("/..."), never another
/// site ("//host", "/\\host", "https://..."), nor anything with a control character; else
/// "/".
pub fn safe_next(next: &str) -> String {
    let ok = next.starts_with('/')
        && !next.starts_with("//")
        && !next.starts_with("/\\")
        && !next.chars().any(char::is_control);
    if ok { next.to_owned() } else { "/".into() }
}
