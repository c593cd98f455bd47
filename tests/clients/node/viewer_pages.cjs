// Drives the viewer's pages in Debian's chromium (headless, through playwright-core; no
// browser download) and prints one JSON line: per page its HTTP status, console errors,
// counts read from the DOM, and a screenshot saved under GRAFT_SHOTS.
//
// env: GRAFT_VIEW_URL   the viewer's base URL (http://127.0.0.1:PORT, or .../ui)
//      GRAFT_VIEW_PAGES JSON list of {"name": ..., "path": ...}
//      GRAFT_VIEW_AUTH  optional: the Authorization header value for every request
//      GRAFT_VIEW_LOGIN optional: the admin key, typed into the login form first (after a
//                       wrong key, whose answer is recorded too); then every page is
//                       loaded with the cookie the login set. The result is out._login.
//      A page may name `follow`: selectors of links clicked in turn on it (each click's
//      URL, `.range` text and call count recorded in `followed`), and `full: false` for a
//      screenshot of the first screen only (a long page).
//      GRAFT_SHOTS      folder for the screenshots (NAME.png)
//      CHROMIUM         the browser (default /usr/bin/chromium)
const fs = require("fs");
const os = require("os");
const path = require("path");
const { chromium } = require("playwright-core");

(async () => {
  const base = process.env.GRAFT_VIEW_URL;
  const pages = JSON.parse(process.env.GRAFT_VIEW_PAGES);
  const shots = process.env.GRAFT_SHOTS;
  fs.mkdirSync(shots, { recursive: true });
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), "graft-chromium-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: [
      "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
    ],
    viewport: { width: 1280, height: 900 },
    extraHTTPHeaders: process.env.GRAFT_VIEW_AUTH ? { authorization: process.env.GRAFT_VIEW_AUTH } : {},
  });
  const out = {};
  if (process.env.GRAFT_VIEW_LOGIN) {
    const page = await context.newPage();
    const first = await page.goto(base + "/", { waitUntil: "load" });
    const form = await page.evaluate(() => ({
      form: !!document.querySelector("form#login"),
      password: !!document.querySelector('form#login input[type="password"][name="key"]'),
      error: document.querySelector("#error")?.textContent ?? null,
    }));
    await page.screenshot({ path: path.join(shots, "login.png") });
    await page.fill('input[name="key"]', "not-the-admin-key");
    const [wrong] = await Promise.all([page.waitForNavigation(), page.click('button[type="submit"]')]);
    const wrongDom = await page.evaluate(() => ({
      form: !!document.querySelector("form#login"),
      error: document.querySelector("#error")?.textContent ?? null,
      text: document.body.innerText,
    }));
    await page.screenshot({ path: path.join(shots, "login-wrong.png") });
    await page.fill('input[name="key"]', process.env.GRAFT_VIEW_LOGIN);
    const [right] = await Promise.all([page.waitForNavigation(), page.click('button[type="submit"]')]);
    const cookies = await context.cookies();
    out._login = {
      first_status: first ? first.status() : 0, ...form,
      wrong_status: wrong ? wrong.status() : 0, wrong: wrongDom,
      after_status: right ? right.status() : 0, after_url: page.url(),
      after_h1: await page.evaluate(() => document.querySelector("h1")?.textContent ?? null),
      cookies: cookies.map((c) => ({ name: c.name, value: c.value, httpOnly: c.httpOnly, sameSite: c.sameSite, path: c.path, secure: c.secure })),
    };
    await page.close();
  }
  for (const p of pages) {
    const page = await context.newPage();
    const errors = [];
    page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
    page.on("pageerror", (e) => errors.push(String(e)));
    page.on("requestfailed", (r) => errors.push(`request failed: ${r.url()}`));
    const resp = await page.goto(base + p.path, { waitUntil: "load" });
    const dom = await page.evaluate(() => ({
      title: document.title,
      h1: document.querySelector("h1")?.textContent ?? null,
      error: document.querySelector("#error")?.textContent ?? null,
      sessions: [...document.querySelectorAll("tr.session td:first-child")].map((e) => e.textContent.trim()),
      session_calls: [...document.querySelectorAll("tr.session td.calls")].map((e) => Number(e.textContent)),
      groups: [...document.querySelectorAll("tr.group td:first-child")].map((e) => e.textContent.trim()),
      members: [...document.querySelectorAll("tr.member td:first-child")].map((e) => e.textContent.trim()),
      samples: [...document.querySelectorAll("tr.sample td:first-child")].map((e) => e.textContent.trim()),
      matched: document.querySelector("#matched")?.textContent ?? null,
      calls: document.querySelectorAll(".call").length,
      tool_calls: document.querySelectorAll(".toolcall").length,
      tokens: document.querySelectorAll(".tok").length,
      trained: [...document.querySelectorAll(".tok.trained")].map((e) => Number(e.dataset.i)),
      // Fork and drift marks in the token text, each with the index of the token it stands
      // before (null at the end).
      events: [...document.querySelectorAll("#tokens .event")].map((e) => {
        let n = e.nextElementSibling;
        while (n && !n.classList.contains("tok")) n = n.nextElementSibling;
        return { kind: e.dataset.kind, at: Number(e.dataset.at), reason: e.dataset.reason, before: n ? Number(n.dataset.i) : null };
      }),
      event_rows: document.querySelectorAll("tr.eventrow").length,
      points: document.querySelectorAll('circle.point[data-series="reward mean"]').length,
      steps: document.querySelectorAll("tr.step").length,
      scripts: document.querySelectorAll("script").length,
      // Wider than the window: something runs past the page's edge.
      overflow: document.documentElement.scrollWidth > document.documentElement.clientWidth,
      range: document.querySelector(".pager .range")?.textContent ?? null,
      callids: [...document.querySelectorAll(".call .callid")].map((e) => e.innerText),
      text: document.body.innerText,
    }));
    await page.screenshot({ path: path.join(shots, `${p.name}.png`), fullPage: p.full !== false });
    const followed = [];
    for (const sel of p.follow || []) {
      await Promise.all([page.waitForNavigation(), page.click(sel)]);
      followed.push(await page.evaluate(() => ({
        url: location.pathname + location.search,
        range: document.querySelector(".pager .range")?.textContent ?? null,
        calls: document.querySelectorAll(".call").length,
        overflow: document.documentElement.scrollWidth > document.documentElement.clientWidth,
      })));
    }
    out[p.name] = { status: resp ? resp.status() : 0, errors, followed, ...dom };
    await page.close();
  }
  await context.close();
  fs.rmSync(profile, { recursive: true, force: true });
  console.log(JSON.stringify(out));
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
