"""What the web UI's page carries besides its components: a script in its head (HEAD_JS) and
its own CSS, both given to `launch` by `app.ui.run`. Apart from `app.view`, whose HTML they style
and act on, so that each stays short.
"""

# A click on a change picture saves it: the link takes the picture's data URI just before the
# browser follows it (capture phase), so the page holds each picture once.
HEAD_JS = """<script>
// Browsers give a page the camera only in a secure context (HTTPS, or localhost): say so on
// the Browser webcam tab instead of leaving its camera button to fail silently.
if (!window.isSecureContext) document.documentElement.classList.add("vs-insecure");
document.addEventListener("click", (e) => {
  const a = e.target.closest && e.target.closest("a.vs-save");
  const img = a && a.querySelector("img");
  if (img) a.href = img.src;
}, true);
// The sample a page plays on opening stops while the page is hidden (another browser tab, a
// minimised window) or on a tab that wants the engine, and starts over back on Live
// (app/page_events.py): a page left open in the background kept the server's cores busy for nobody.
// Said once things settle: each tab's own event, run side by side on the server, left a quick
// Video file -> Live stopped.
// Which tab shows is read from the panels (app/ui.py gives each an id), not from the tab buttons:
// on a narrow window Gradio moves tabs into an overflow menu whose items are no tab buttons.
const VS_PAUSING_TABS = ["vs-tab-webcam", "vs-tab-video", "vs-tab-image"];
let vsSettle = null;
function vsSayWhere() {
  clearTimeout(vsSettle);
  vsSettle = setTimeout(() => {
    const name = ["vs-tab-live", ...VS_PAUSING_TABS, "vs-tab-settings"].find((id) => {
      const panel = document.getElementById(id);
      return panel && panel.offsetParent !== null;
    }) || "";
    const away = document.visibilityState === "hidden" || VS_PAUSING_TABS.includes(name);
    if (!away && name !== "vs-tab-live") return;  // Settings: as it was
    const button = document.getElementById(away ? "vs-page-hidden" : "vs-page-shown");
    if (button) button.click();
  }, 200);
}
document.addEventListener("visibilitychange", vsSayWhere);
const vsOwn = (e) => e.target.closest && e.target.closest("#vs-page-hidden, #vs-page-shown");
document.addEventListener("click", (e) => { if (!vsOwn(e)) vsSayWhere(); }, true);
// The page's own clicks stop at the document (this listener is its first): Gradio's handlers of
// those buttons have run by then (it listens below the document), and on the window its overflow
// menu of tabs (a narrow window) takes any click for one outside it and closes: it shut 200 ms
// after it opened, on Live.
document.addEventListener("click", (e) => { if (vsOwn(e)) e.stopImmediatePropagation(); });
// Screen readers: each new caption of the feed in view, or its error, is said once, by a live
// region of the page's own. The caption under the frame is text, but rebuilt with every frame (15
// a second), so a live region inside it would be new each time: said never, or for every frame.
// The other tabs' results too (a video job's note, an image's answer, Settings' Apply): Gradio
// says only its own error messages.
const VS_SAID = ["#vs-caption", "#vs-video-note", "#vs-image-text textarea", "#vs-settings-status"];
let vsSaid = "";
function vsAnnounce() {
  // The caption log, an output, is a disabled textarea in Gradio: no stop of the Tab key, so a
  // keyboard could not scroll past its first 14 lines. Read-only instead: focusable, unchanged.
  const log = document.querySelector("#vs-log textarea");
  if (log && log.disabled) { log.disabled = false; log.readOnly = true; }
  let region = document.getElementById("vs-announce");
  if (!region) {
    if (!document.body) return;
    region = document.createElement("div");
    region.id = "vs-announce";
    // hidden from sight only; inline, as Gradio scopes our CSS to its own container
    region.style.cssText = "position:absolute;width:1px;height:1px;overflow:hidden;clip:rect(0 0 0 0);"
                           + "white-space:nowrap";
    region.setAttribute("role", "status");
    region.setAttribute("aria-live", "polite");
    document.body.appendChild(region);
  }
  const shown = (sel) => [...document.querySelectorAll(sel)].find((e) => e.offsetParent !== null);
  const words = (e) => (e ? e.value ?? e.textContent : "").trim();  // a textarea's is its value
  const text = words(shown(".vs-error")) || VS_SAID.map((sel) => words(shown(sel))).find((t) => t) || "";
  // Nothing to say (another tab, a result cleared for the next) forgets the last: the same answer
  // again is news, as Apply's "settings applied" twice
  if (text !== vsSaid) { vsSaid = text; if (text) region.textContent = text; }
}
// characterData too: Gradio may update a caption's text node in place
new MutationObserver(vsAnnounce).observe(document.documentElement,
                                         {childList: true, subtree: true, characterData: true});
</script>"""

CSS = """
/* Our own text colours, readable (4.5:1 or more) on Gradio's light and dark themes (Gradio puts
   .dark on the body when the browser prefers dark): fixed greys were 3.4:1 (#666) on the dark one,
   #888 3.5:1 on the light one, and Gradio's own "subdued" text colour is 1.9:1 on white. */
body { --vs-muted: #595959; --vs-error: #b00020; --vs-line: #d4d4d8; }
body.dark { --vs-muted: #b4b4bb; --vs-error: #ff8a80; --vs-line: #52525b; }
/* the page's own buttons (HEAD_JS clicks them): no one else's */
#vs-page-hidden, #vs-page-shown { display: none !important; }
/* a download box holds one file link: no drop area */
.vs-download .empty { min-height: 48px !important; height: 48px; }
#vs-counters { display: flex; flex-wrap: wrap; gap: 6px; }
.vs-counter { border: 1px solid var(--vs-line); border-radius: 6px; padding: 4px 8px; min-width: 90px; }
.vs-counter b { display: block; font-size: 1.15em; }
.vs-counter span { color: var(--vs-muted); font-size: 0.8em; }
.vs-error { color: var(--vs-error); font-weight: bold; margin-top: 6px; }
#vs-caption { font-size: 1.2em; margin-top: 4px; white-space: pre-line; }
.vs-info { color: var(--vs-muted); font-size: 0.85em; }
.vs-empty { color: var(--vs-muted); padding: 40px; border: 1px dashed var(--vs-line); text-align: center; }
#vs-shots { display: flex; flex-wrap: wrap; gap: 8px; }
.vs-shot { margin: 0; width: 200px; }
.vs-shot img { width: 100%; display: block; border-radius: 4px; }
.vs-save { cursor: pointer; display: block; }  /* block: the focus ring goes round the picture */
.vs-save:focus-visible { outline: 3px solid #2563eb; outline-offset: 2px; }
.vs-shot figcaption { font-size: 0.85em; white-space: pre-line; }
#vs-cam-insecure { display: none; }
/* !important: Gradio scopes the rule above under its container, which outranks this one */
.vs-insecure #vs-cam-insecure { display: block !important; }
/* A narrow window: a phone, upright or on its side, or a tablet upright */
@media (max-width: 900px) {
  /* Live: the frame and its caption first, then the controls; the counters and the log, the frame's
     row's other column, below them (a phone scrolled past the source, the prompt form and Start to
     the video playing) */
  #vs-frame-row { display: contents; }
  #vs-frame-col { order: -1; }
  /* the prompt forms stacked, each field the window's width (side by side, the question's label
     and box were ~140 px wide on a phone) */
  .vs-prompt-row .form { flex-direction: column; }
  /* the latency chart no narrower than 600 px, its text 9 px or more (scaled to a phone's width, it
     was ~5 px): its box scrolls sideways instead, and opens at its right end, the newest frames and
     the legend (rtl: a scroll position counted from the right, kept as the chart is redrawn) */
  #vs-chart-box :has(> #vs-chart) { overflow-x: auto; direction: rtl; }
  #vs-chart { min-width: 600px; direction: ltr; margin-right: auto; }
}
"""
