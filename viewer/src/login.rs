//! The browser login of a keyed viewer, the one piece every server of the pages uses
//! (`graft view`, and the gateway under `/ui`): a form posts the admin key once, and the
//! answer sets a cookie that stands for it.
//!
//! - The cookie is not the key: each login gets its own random token, kept in memory only (a
//!   restart logs every browser out; at most [`MAX_LOGINS`] are kept, the oldest dropped), so
//!   a cookie that leaks does not leak the key, nothing on disk can be replayed, and
//!   `POST {base}/logout` ends that one login. The key and the tokens are compared in
//!   constant time. `Authorization: Bearer <key>` keeps working beside it (scripts, curl).
//! - `POST {base}/login` is rate limited per client address ([`LOGIN_BURST`] attempts, then
//!   one every [`LOGIN_EVERY`]): a 429 page with `Retry-After` beyond that.
//!
//! The server owns the listener and the body: it asks [`Login::step`] what to do with each
//! request, reads a login form's body (at most [`MAX_FORM_BYTES`]) when told to, and turns
//! an [`Answer`] into its own response type.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use rand::Rng;
use subtle::ConstantTimeEq;

use crate::{Page, Viewer};

/// The cookie's name.
pub const COOKIE: &str = "graft_view";

/// The largest login form body a server should read (the key and where to go next).
pub const MAX_FORM_BYTES: usize = 16 * 1024;

/// Logins (browser cookies) kept at once; a login past this drops the oldest.
pub const MAX_LOGINS: usize = 1024;

/// Login attempts a client address may make at once …
pub const LOGIN_BURST: u32 = 5;
/// … and then one per this long.
pub const LOGIN_EVERY: Duration = Duration::from_secs(6);

/// The admin key, the tokens of the browsers logged in with it, and the attempts' limit.
pub struct Login {
    key: String,
    /// Prefix of the login's routes and of the cookie's path: "" or "/ui".
    base: String,
    tokens: Mutex<VecDeque<String>>,
    limiter: DefaultKeyedRateLimiter<IpAddr>,
    clock: DefaultClock,
}

/// A login form as posted: the key typed, and the page to go back to.
#[derive(Debug, PartialEq)]
pub struct Form {
    pub key: Option<String>,
    pub next: String,
}

/// What a server answers instead of a page: the page (a login form, a refusal, an empty
/// redirect) and the headers to set with it.
#[derive(Debug)]
pub struct Answer {
    pub page: Page,
    /// `(name, value)`: `set-cookie`, `location`, `www-authenticate`, `retry-after`,
    /// `cache-control`.
    pub headers: Vec<(&'static str, String)>,
}

/// What to do with one request of a keyed server.
#[derive(Debug)]
pub enum Step {
    /// `POST {base}/login`: read the body (at most [`MAX_FORM_BYTES`]) and answer with
    /// [`Login::post_form`].
    ReadForm,
    /// Answer this instead of a page.
    Answer(Answer),
    /// The request carries the key or a login's cookie: serve the page.
    Page,
}

/// The parts of a request the login looks at.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub method: &'a str,
    /// The path, with the server's base.
    pub path: &'a str,
    /// Path and query, where a login goes back to.
    pub path_and_query: &'a str,
    /// The `Cookie` header values.
    pub cookies: &'a [&'a str],
    /// The key sent as `Authorization: Bearer` (or `x-api-key`), if any.
    pub bearer: Option<&'a str>,
}

fn same(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// The values of the login cookie in `Cookie` header values.
fn cookie_values<'a>(cookies: &[&'a str]) -> Vec<&'a str> {
    cookies
        .iter()
        .flat_map(|h| h.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(name, _)| name.trim() == COOKIE)
        .map(|(_, v)| v.trim())
        .collect()
}

fn redirect(to: &str) -> Answer {
    Answer {
        page: Page {
            status: 303,
            content_type: "text/html; charset=utf-8",
            body: String::new(),
        },
        headers: vec![
            ("location", to.to_owned()),
            ("cache-control", "no-store".into()),
        ],
    }
}

impl Login {
    /// A login for `key` on a server whose pages are under `base` ("" or "/ui").
    pub fn new(key: &str, base: &str) -> Login {
        let every = LOGIN_EVERY.as_millis().max(1) as u64;
        let quota = Quota::with_period(Duration::from_millis(every))
            .unwrap_or_else(|| Quota::per_second(NonZeroU32::MIN))
            .allow_burst(NonZeroU32::new(LOGIN_BURST).unwrap_or(NonZeroU32::MIN));
        Login {
            key: key.to_owned(),
            base: base.trim_end_matches('/').to_owned(),
            tokens: Mutex::new(VecDeque::new()),
            limiter: RateLimiter::keyed(quota),
            clock: DefaultClock::default(),
        }
    }

    /// Whether `sent` is the admin key (constant time).
    pub fn key_matches(&self, sent: &str) -> bool {
        same(sent, &self.key)
    }

    /// Whether `Cookie` header values carry the token of a login that is still on.
    pub fn cookie_matches(&self, cookies: &[&str]) -> bool {
        let Ok(tokens) = self.tokens.lock() else {
            return false;
        };
        cookie_values(cookies).into_iter().any(|v| {
            // Every token compared, each in constant time.
            tokens.iter().fold(false, |hit, t| hit | same(v, t))
        })
    }

    /// A new login: its token kept, and the `Set-Cookie` value that hands it to the browser:
    /// `HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page sends it),
    /// `Path` the pages' base. Not `Secure`: `graft view` serves plain HTTP, and a browser
    /// would not send a Secure cookie back over it (put TLS in front on a network you do not
    /// trust; the gateway's own TLS listener carries it as it is).
    pub fn start(&self) -> String {
        let bytes: [u8; 32] = rand::rng().random();
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        if let Ok(mut t) = self.tokens.lock() {
            if t.len() >= MAX_LOGINS {
                t.pop_front();
            }
            t.push_back(token.clone());
        }
        format!(
            "{COOKIE}={token}; HttpOnly; SameSite=Strict; Path={}",
            self.cookie_path()
        )
    }

    fn cookie_path(&self) -> &str {
        if self.base.is_empty() {
            "/"
        } else {
            &self.base
        }
    }

    /// Ends the logins whose tokens the `Cookie` header values carry; returns the
    /// `Set-Cookie` value that deletes the cookie in the browser.
    pub fn end(&self, cookies: &[&str]) -> String {
        if let Ok(mut t) = self.tokens.lock() {
            for v in cookie_values(cookies) {
                t.retain(|x| !same(v, x));
            }
        }
        format!(
            "{COOKIE}=; HttpOnly; SameSite=Strict; Path={}; Max-Age=0",
            self.cookie_path()
        )
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

    /// What to do with `req` (see [`Step`]): the login form's post, a logout, the login
    /// page (401) for a request with neither the key nor a login's cookie, else the page.
    pub fn step(&self, viewer: &Viewer, req: Request<'_>) -> Step {
        let rel = req.path.strip_prefix(self.base.as_str()).unwrap_or("");
        match (req.method, rel) {
            ("POST", "/login") => return Step::ReadForm,
            ("POST", "/logout") => {
                let mut a = redirect(&format!("{}/", self.base));
                a.headers.push(("set-cookie", self.end(req.cookies)));
                return Step::Answer(a);
            }
            _ => {}
        }
        let bearer_ok = req.bearer.is_some_and(|k| self.key_matches(k));
        if !bearer_ok && !self.cookie_matches(req.cookies) {
            let next = if rel == "/login" {
                format!("{}/", self.base)
            } else {
                req.path_and_query.to_owned()
            };
            let reason = if req.bearer.is_some() {
                "that key is not the admin key: log in with the admin key, or send 'Authorization: Bearer <key>'"
            } else {
                "these pages need the admin key: log in with it below, or send 'Authorization: Bearer <key>'"
            };
            return Step::Answer(self.login_page(viewer, reason, &next));
        }
        if rel == "/login" {
            return Step::Answer(redirect(&format!("{}/", self.base)));
        }
        Step::Page
    }

    fn login_page(&self, viewer: &Viewer, message: &str, next: &str) -> Answer {
        Answer {
            page: viewer.login_page(message, next),
            headers: vec![
                ("www-authenticate", "Bearer".into()),
                ("cache-control", "no-store".into()),
            ],
        }
    }

    /// `POST {base}/login` with its form `body`, from `peer`: past the attempts' limit a
    /// 429 page; the key right, a new login's cookie and back to where the browser was
    /// going; wrong or missing, the form again with why (401). The key is never echoed.
    pub fn post_form(&self, viewer: &Viewer, body: &[u8], peer: Option<IpAddr>) -> Answer {
        let peer = peer.unwrap_or(IpAddr::from([0, 0, 0, 0]));
        if let Err(not_until) = self.limiter.check_key(&peer) {
            let wait = not_until.wait_time_from(self.clock.now()).as_secs().max(1);
            return Answer {
                page: viewer.error_page(
                    429,
                    &format!(
                        "too many login attempts from {peer}: at most {LOGIN_BURST} at once, then one every {} s; try again in {wait} s",
                        LOGIN_EVERY.as_secs()
                    ),
                ),
                headers: vec![("retry-after", wait.to_string())],
            };
        }
        if self.limiter.len() > 4 * MAX_LOGINS {
            self.limiter.retain_recent();
        }
        let form = Login::form(body);
        let next = if form.next == "/" && !self.base.is_empty() {
            format!("{}/", self.base)
        } else {
            form.next
        };
        match form.key {
            None => self.login_page(viewer, "type the admin key to log in", &next),
            Some(k) if !self.key_matches(&k) => {
                self.login_page(viewer, "that is not the admin key; try again", &next)
            }
            Some(_) => {
                let mut a = redirect(&next);
                a.headers.push(("set-cookie", self.start()));
                a
            }
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
