// kcloak live map: draws the frames of GET /v1/map/stream (Server-Sent Events) on a canvas.
// No library, no tiles, no third-party request: streets come from GET /v1/map/streets.
// With tokens, open the page as /map#token=<a map viewer's token>; the fragment never leaves
// the browser, and the token is sent only to this broker, in the Authorization header.
"use strict";

(function () {
  const K_BINS = [
    { lo: 0, hi: 4, color: "#c0392b", label: "k < 5" },
    { lo: 5, hi: 9, color: "#e67e22", label: "k 5–9" },
    { lo: 10, hi: 19, color: "#16a085", label: "k 10–19" },
    { lo: 20, hi: 49, color: "#2c6fbb", label: "k 20–49" },
    { lo: 50, hi: Infinity, color: "#6c3483", label: "k ≥ 50" },
  ];
  const KEEP_RAW = 300;
  const state = {
    frames: 0,
    received: [], // the raw data of the latest frames, for inspection
    last: null,
    streets: null,
    extent: null,
    error: null,
  };
  window.kcloakMap = state;

  const canvas = document.getElementById("map");
  const statusEl = document.getElementById("status");
  const token = new URLSearchParams(location.hash.slice(1)).get("token");
  const headers = token ? { Authorization: "Bearer " + token } : {};

  function setStatus(text, cls) {
    statusEl.textContent = text;
    statusEl.className = "status " + cls;
  }

  function kColor(k) {
    for (const b of K_BINS) if (k >= b.lo && k <= b.hi) return b.color;
    return K_BINS[K_BINS.length - 1].color;
  }

  function fmt(v, digits) {
    if (v === null || v === undefined) return "–";
    return Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
  }

  // -- extent and projection (equirectangular, x scaled by cos(latitude)) ----------------------
  function grow(ext, lon0, lat0, lon1, lat1) {
    if (!ext) return [lon0, lat0, lon1, lat1];
    return [Math.min(ext[0], lon0), Math.min(ext[1], lat0), Math.max(ext[2], lon1), Math.max(ext[3], lat1)];
  }

  function dataExtent(frame) {
    let ext = null;
    const g = frame.regions.grid_deg;
    for (const r of frame.regions.rows) ext = grow(ext, r[0] * g, r[1] * g, r[2] * g, r[3] * g);
    const c = frame.density.cell_deg;
    for (const cell of frame.density.cells) ext = grow(ext, cell[0] * c, cell[1] * c, (cell[0] + 1) * c, (cell[1] + 1) * c);
    return ext;
  }

  function projection(w, h) {
    const ext = state.extent;
    if (!ext) return null;
    const midLat = (ext[1] + ext[3]) / 2;
    const kx = Math.cos((midLat * Math.PI) / 180);
    const spanX = Math.max((ext[2] - ext[0]) * kx, 1e-6);
    const spanY = Math.max(ext[3] - ext[1], 1e-6);
    const pad = 14;
    const s = Math.min((w - 2 * pad) / spanX, (h - 2 * pad) / spanY);
    const ox = pad + (w - 2 * pad - spanX * s) / 2;
    const oy = pad + (h - 2 * pad - spanY * s) / 2;
    return {
      x: (lon) => ox + (lon - ext[0]) * kx * s,
      y: (lat) => oy + (ext[3] - lat) * s,
      metresPerPx: 111320 / s,
    };
  }

  // -- drawing ---------------------------------------------------------------------------------
  function draw() {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth;
    const h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const p = projection(w, h);
    if (!p) return;
    if (state.streets) {
      ctx.strokeStyle = "#c9ccd2";
      ctx.lineWidth = 0.8;
      ctx.beginPath();
      for (const line of state.streets.lines) {
        ctx.moveTo(p.x(line[0]), p.y(line[1]));
        for (let i = 2; i < line.length; i += 2) ctx.lineTo(p.x(line[i]), p.y(line[i + 1]));
      }
      ctx.stroke();
    }
    const frame = state.last;
    if (!frame) return;
    const c = frame.density.cell_deg;
    const cells = frame.density.cells;
    const maxN = cells.reduce((m, cell) => Math.max(m, cell[2]), 1);
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    for (const [cx, cy, n] of cells) {
      const x0 = p.x(cx * c), x1 = p.x((cx + 1) * c), y0 = p.y((cy + 1) * c), y1 = p.y(cy * c);
      ctx.fillStyle = `rgba(70, 70, 80, ${(0.05 + 0.3 * (n / maxN)).toFixed(3)})`;
      ctx.fillRect(x0, y0, x1 - x0, y1 - y0);
      ctx.strokeStyle = "rgba(70, 70, 80, 0.3)";
      ctx.lineWidth = 0.5;
      ctx.strokeRect(x0, y0, x1 - x0, y1 - y0);
      if (x1 - x0 > 26 && y1 - y0 > 14) {
        ctx.fillStyle = "rgba(30, 30, 40, 0.8)";
        ctx.fillText(String(n), (x0 + x1) / 2, (y0 + y1) / 2);
      }
    }
    const g = frame.regions.grid_deg;
    const maxAge = frame.regions.max_age_s;
    const rows = frame.regions.rows.slice().reverse(); // oldest first, newest on top
    for (const [x0, y0, x1, y1, k, age] of rows) {
      const fade = Math.max(0.15, 1 - age / maxAge);
      const px0 = p.x(x0 * g), px1 = p.x(x1 * g), py0 = p.y(y1 * g), py1 = p.y(y0 * g);
      ctx.globalAlpha = fade;
      ctx.strokeStyle = kColor(k);
      ctx.lineWidth = 1.3;
      ctx.strokeRect(px0, py0, Math.max(px1 - px0, 1), Math.max(py1 - py0, 1));
    }
    ctx.globalAlpha = 1;
    const metres = niceLength(p.metresPerPx * 120);
    const scale = document.getElementById("scale");
    scale.style.width = metres / p.metresPerPx + "px";
    scale.textContent = metres >= 1000 ? metres / 1000 + " km" : metres + " m";
  }

  function niceLength(m) {
    const e = Math.pow(10, Math.floor(Math.log10(m)));
    for (const f of [5, 2, 1]) if (f * e <= m) return f * e;
    return e;
  }

  // -- panel -----------------------------------------------------------------------------------
  function setText(id, text) {
    document.getElementById(id).textContent = text;
  }

  function panel(frame) {
    const c = frame.counters;
    setText("c-users", fmt(c.users_present, 0));
    setText("c-updates", fmt(c.updates, 0));
    setText("c-rate", fmt(c.updates_per_s, 0));
    setText("c-queries", fmt(c.queries, 0));
    setText("c-success", c.success_rate === null ? "–" : fmt(c.success_rate * 100, 1) + " %");
    setText("c-p99", c.p99_ms === null ? "–" : fmt(c.p99_ms, 1) + " ms");
    const ref = document.getElementById("refusals");
    ref.replaceChildren();
    const reasons = Object.entries(c.refusals);
    if (!reasons.length) {
      const td = ref.insertRow().insertCell();
      td.className = "none";
      td.textContent = "none";
    }
    for (const [reason, n] of reasons) {
      const tr = ref.insertRow();
      const th = document.createElement("th");
      th.textContent = reason;
      tr.appendChild(th);
      tr.insertCell().textContent = fmt(n, 0);
    }
    const w = frame.windows;
    const outcomes = Object.entries(w.by_outcome).map(([o, n]) => `${n} ${o}`);
    setText("w-counts", outcomes.length ? outcomes.join(", ") : "none yet");
    const table = document.getElementById("windows");
    table.replaceChildren();
    if (w.recent.length) {
      const head = table.insertRow();
      for (const name of ["window (UTC)", "k", "in", "out", "status"]) {
        const th = document.createElement("th");
        th.textContent = name;
        head.appendChild(th);
      }
    }
    for (const win of w.recent) {
      const tr = table.insertRow();
      const t0 = new Date(win.t_start * 1000).toISOString().slice(11, 19);
      const t1 = new Date(win.t_end * 1000).toISOString().slice(11, 19);
      for (const v of [`${t0}–${t1}`, win.k, win.n_in, win.n_out, win.status]) tr.insertCell().textContent = v;
    }
    const d = frame.density;
    setText(
      "privacy",
      `Aggregates only. Regions are the forwarded ones widened to a ${g3(frame.regions.grid_deg)}° grid; ` +
        `cells are ${g3(d.cell_deg)}° and hide fewer than ${d.min_k} users ` +
        `(${d.hidden_cells} cells, ${d.hidden_users} users hidden now).`
    );
  }

  function g3(v) {
    return Number(v).toString();
  }

  function legend() {
    const box = document.getElementById("legend");
    for (const b of K_BINS) {
      const row = document.createElement("div");
      row.className = "legend-row";
      const sw = document.createElement("span");
      sw.className = "swatch";
      sw.style.borderColor = b.color;
      row.append(sw, "region, achieved " + b.label);
      box.appendChild(row);
    }
    const row = document.createElement("div");
    row.className = "legend-row";
    const sw = document.createElement("span");
    sw.className = "swatch cell";
    row.append(sw, "users per density cell");
    box.appendChild(row);
  }

  // -- data ------------------------------------------------------------------------------------
  function onFrame(data) {
    const frame = JSON.parse(data);
    state.frames += 1;
    state.received.push(data);
    if (state.received.length > KEEP_RAW) state.received.shift();
    state.last = frame;
    const ext = dataExtent(frame);
    if (ext) state.extent = state.extent ? grow(state.extent, ...ext) : ext;
    panel(frame);
    draw();
  }

  async function loadStreets(tries) {
    const resp = await fetch("/v1/map/streets", { headers, cache: "no-store" });
    const doc = resp.ok ? await resp.json() : null;
    if (doc && doc.bbox) {
      state.streets = doc;
      state.extent = state.extent ? grow(state.extent, ...doc.bbox) : doc.bbox;
      draw();
    } else if (resp.ok && tries > 1) {
      // none yet (the demo writes its streets while the broker starts): ask again shortly
      setTimeout(() => loadStreets(tries - 1).catch(() => {}), 3000);
    }
  }

  async function stream() {
    const resp = await fetch("/v1/map/stream", { headers, cache: "no-store" });
    if (resp.status === 401 || resp.status === 403) {
      const body = await resp.json().catch(() => ({}));
      const msg = (body.error && body.error.message) || "not allowed";
      setStatus("no access: " + msg + (token ? "" : " (open /map#token=…)"), "bad");
      state.error = resp.status;
      return false;
    }
    if (!resp.ok || !resp.body) throw new Error("HTTP " + resp.status);
    setStatus("live", "ok");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (event === "frame" && data.length) onFrame(data.join("\n"));
      }
    }
    return true;
  }

  async function run() {
    legend();
    loadStreets(20).catch(() => {});
    for (;;) {
      try {
        if ((await stream()) === false) return;
        setStatus("reconnecting…", "wait");
      } catch (e) {
        setStatus("disconnected, retrying…", "bad");
      }
      await new Promise((r) => setTimeout(r, 2000));
    }
  }

  window.addEventListener("resize", draw);
  run();
})();
