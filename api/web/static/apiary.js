// Apiary's web view: keeps the server-rendered pages live through the SSE streams and draws the charts
// (uPlot). Every text that comes from the server as data is set with textContent, never as HTML; the
// HTML that is swapped in (`?part=live`) is rendered, and escaped, by the server.
(function () {
  "use strict";
  const page = document.body.dataset.page;
  const liveDot = document.getElementById("live-status");
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f"];

  function setLive(ok) { liveDot.className = ok ? "live" : "muted"; }

  // The page's Content-Security-Policy refuses inline style attributes: bars and swatches carry their
  // width or colour as data, set here (through the CSSOM, which the policy allows).
  function applyStyles(root) {
    for (const bar of root.querySelectorAll("[data-width]")) bar.style.width = `${bar.dataset.width}%`;
    for (const swatch of root.querySelectorAll("[data-color]")) swatch.style.background = swatch.dataset.color;
  }
  applyStyles(document);
  // Sent with every request that changes something (api.deps.check_same_site).
  const csrfToken = (document.querySelector('meta[name="csrf-token"]') || {}).content || "";

  function liveUrl() {
    const params = new URLSearchParams(location.search);
    params.set("part", "live");
    return location.pathname + "?" + params.toString();
  }

  let swapping = null;
  let swapAgain = false;
  // Replace #live with a fresh rendering of it; calls that come while one runs are folded into one more.
  async function swapLive(after) {
    if (swapping) { swapAgain = true; return swapping; }
    swapping = (async () => {
      do {
        swapAgain = false;
        try {
          const response = await fetch(liveUrl(), { headers: { Accept: "text/html" } });
          if (response.ok) {
            const live = document.getElementById("live");
            live.innerHTML = await response.text();
            applyStyles(live);
            if (after) after();
          }
        } catch (err) { /* the server is away for a moment: the next update retries */ }
      } while (swapAgain);
      swapping = null;
    })();
    return swapping;
  }

  function median(values) {
    if (!values.length) return null;
    const sorted = values.slice().sort((a, b) => a - b);
    return sorted[Math.floor(sorted.length / 2)];
  }

  // -- the queue page ----------------------------------------------------------------------------
  function queuePage() {
    const syncPicks = comparePicker();
    const sparks = new Map(); // job id -> {at, losses}
    async function drawSparklines() {
      for (const canvas of document.querySelectorAll("canvas.sparkline")) {
        const id = canvas.dataset.job;
        let cached = sparks.get(id);
        if (!cached || Date.now() - cached.at > 5000) {
          try {
            const response = await fetch(`/jobs/${id}/metrics?rank=0&points=60`);
            if (!response.ok) continue;
            const body = await response.json();
            cached = { at: Date.now(), losses: body.data.map((p) => p.values.loss).filter((v) => v !== undefined) };
            sparks.set(id, cached);
          } catch (err) { continue; }
        }
        sparkline(canvas, cached.losses);
      }
    }
    function sparkline(canvas, values) {
      const ctx = canvas.getContext("2d");
      ctx.clearRect(0, 0, canvas.width, canvas.height);
      canvas.dataset.points = String(values.length);
      if (values.length < 2) return;
      const lo = Math.min(...values), hi = Math.max(...values), span = hi - lo || 1;
      ctx.strokeStyle = COLORS[0];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      values.forEach((v, i) => {
        const x = (i / (values.length - 1)) * (canvas.width - 2) + 1;
        const y = canvas.height - 2 - ((v - lo) / span) * (canvas.height - 4);
        if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.stroke();
    }
    const stream = new EventSource("/queues/stream");
    stream.onopen = () => setLive(true);
    stream.onerror = () => setLive(false);
    let first = true;
    stream.addEventListener("queues", () => {
      if (first) { first = false; return; } // the page was just rendered from the same state
      swapLive(() => { syncPicks(); drawSparklines(); });
    });
    // Running jobs' progress does not change the queues: it is refreshed on a timer.
    setInterval(() => swapLive(() => { syncPicks(); drawSparklines(); }), 5000);
    drawSparklines();
  }

  // -- the job page --------------------------------------------------------------------------------
  function jobPage() {
    const jobId = document.body.dataset.job;
    const byRank = new Map(); // rank -> Map(step -> point)
    const charts = {};
    let redrawTimer = null;

    function addPoints(points) {
      for (const point of points) {
        if (!byRank.has(point.rank)) byRank.set(point.rank, new Map());
        byRank.get(point.rank).set(point.step, point); // a replayed step replaces the abandoned one
      }
      if (!redrawTimer) redrawTimer = setTimeout(() => { redrawTimer = null; redraw(); }, 200);
    }

    // Where the run restarted: (attempt, segment) changes from one step to the next of the lowest rank.
    function markers() {
      const ranks = [...byRank.keys()].sort((a, b) => a - b);
      if (!ranks.length) return [];
      const points = [...byRank.get(ranks[0]).values()].sort((a, b) => a.step - b.step);
      const found = [];
      for (let i = 1; i < points.length; i++) {
        const a = points[i - 1], b = points[i];
        if (a.attempt !== b.attempt) found.push({ step: b.step, label: `attempt ${b.attempt}` });
        else if (a.segment !== b.segment) found.push({ step: b.step, label: "restart" });
      }
      return found;
    }

    // `reduced`: a value the ranks agreed on (an eval), recorded by rank 0 alone.
    function series(key, reduced) {
      const ranks = [...byRank.keys()].sort((a, b) => a - b).filter((rank) => !reduced || rank === 0);
      const steps = new Set();
      for (const rank of ranks) {
        for (const [step, point] of byRank.get(rank)) if (!reduced || key in point.values) steps.add(step);
      }
      const xs = [...steps].sort((a, b) => a - b);
      const data = [xs];
      for (const rank of ranks) {
        const points = byRank.get(rank);
        data.push(xs.map((step) => { const p = points.get(step); return p && key in p.values ? p.values[key] : null; }));
      }
      return { ranks, data };
    }

    function drawMarkers(u) {
      const ctx = u.ctx;
      ctx.save();
      ctx.strokeStyle = "#b45309";
      ctx.fillStyle = "#b45309";
      ctx.setLineDash([4, 4]);
      ctx.font = `${10 * devicePixelRatio}px sans-serif`;
      for (const marker of markers()) {
        const x = Math.round(u.valToPos(marker.step, "x", true));
        if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
        ctx.beginPath();
        ctx.moveTo(x, u.bbox.top);
        ctx.lineTo(x, u.bbox.top + u.bbox.height);
        ctx.stroke();
        ctx.fillText(marker.label, x + 3, u.bbox.top + 12);
      }
      ctx.restore();
    }

    function draw(name, key, reduced = false) {
      const element = document.getElementById(name);
      const { ranks, data } = series(key, reduced);
      element.dataset.points = String(data[0].length);
      const existing = charts[name];
      if (existing && existing.ranks === ranks.join(",")) { existing.plot.setData(data); return; }
      if (existing) existing.plot.destroy();
      const options = {
        width: Math.max(300, element.clientWidth || 600),
        height: 240,
        scales: { x: { time: false } },
        axes: [{ label: "step" }, {}],
        series: [{ label: "step" }, ...ranks.map((rank, i) => ({
          label: `rank ${rank}`, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true, points: { show: false },
        }))],
        hooks: { draw: [drawMarkers] },
      };
      charts[name] = { ranks: ranks.join(","), plot: new uPlot(options, data, element) };
    }

    function redraw() {
      draw("loss-chart", "loss");
      draw("throughput-chart", "samples_per_s");
      if (document.getElementById("eval-chart")) draw("eval-chart", "eval_loss", true);
      rankStats();
    }

    // Each rank's median step time and data wait over its last 50 steps, beside the ranks table.
    function rankStats() {
      for (const [rank, points] of byRank) {
        const recent = [...points.values()].sort((a, b) => a.step - b.step).slice(-50);
        const row = document.querySelector(`tr[data-rank="${rank}"]`);
        if (!row) continue;
        const stepTime = median(recent.map((p) => p.values.step_time_s).filter((v) => v !== undefined));
        const dataWait = median(recent.map((p) => p.values.data_wait_s).filter((v) => v !== undefined));
        row.querySelector(".step-time").textContent = stepTime === null ? "-" : `${(stepTime * 1000).toFixed(1)} ms`;
        row.querySelector(".data-wait").textContent = dataWait === null ? "-" : `${(dataWait * 1000).toFixed(1)} ms`;
      }
    }

    function addEvent(event) {
      const row = document.createElement("tr");
      const at = new Date(event.at);
      const cells = [
        at.toTimeString().slice(0, 8),
        event.from_state !== event.to_state ? `${event.from_state || ""} \u2192 ${event.to_state || ""}` : "",
        event.actor,
        event.reason,
      ];
      for (const text of cells) { const cell = document.createElement("td"); cell.textContent = text; row.appendChild(cell); }
      row.lastChild.className = "reason";
      document.getElementById("events").appendChild(row);
    }

    async function refreshLogs() {
      const section = document.getElementById("logs-section");
      try {
        const response = await fetch(`/jobs/${jobId}/logs?tail=200`);
        if (!response.ok) { section.hidden = true; return; } // no logs route, or none yet
        document.getElementById("logs").textContent = await response.text();
        section.hidden = false;
      } catch (err) { section.hidden = true; }
    }

    document.addEventListener("click", async (click) => {
      const button = click.target.closest("button[data-action]");
      if (!button) return;
      const error = document.getElementById("action-error");
      error.textContent = "";
      button.disabled = true;
      const response = await fetch(`/jobs/${jobId}/${button.dataset.action}`, {
        method: "POST",
        headers: { "X-CSRF-Token": csrfToken },
      });
      if (!response.ok) {
        let message = `${response.status}`;
        try { message = (await response.json()).message || message; } catch (err) { /* not JSON */ }
        error.textContent = message;
        button.disabled = false;
        return;
      }
      swapLive(rankStats);
    });

    async function start() {
      try {
        const response = await fetch(`/jobs/${jobId}/metrics?points=1000&limit=100000`);
        if (response.ok) addPoints((await response.json()).data);
      } catch (err) { /* the stream brings what is new */ }
      redraw();
      refreshLogs();
      const cursor = encodeURIComponent(document.body.dataset.cursor);
      const stream = new EventSource(`/jobs/${jobId}/stream?last_event_id=${cursor}`);
      let first = true;
      stream.onopen = () => setLive(true);
      stream.onerror = () => setLive(stream.readyState === EventSource.OPEN);
      stream.addEventListener("state", (message) => {
        const job = JSON.parse(message.data);
        const state = document.getElementById("job-state");
        if (state) { state.textContent = job.state; state.className = `state state-${job.state}`; }
        if (first) { first = false; return; }
        swapLive(rankStats);
        refreshLogs();
      });
      stream.addEventListener("event", (message) => addEvent(JSON.parse(message.data)));
      stream.addEventListener("metrics", (message) => addPoints(JSON.parse(message.data).data));
      stream.addEventListener("end", () => {
        stream.close();
        setLive(false);
        swapLive(rankStats);
        refreshLogs();
      });
    }
    start();
  }

  // -- the compare page: each job's rank-0 curve, overlaid -----------------------------------------
  function comparePage() {
    const ids = document.body.dataset.jobs.split(",");
    async function start() {
      const runs = await Promise.all(ids.map(async (id) => {
        try {
          const response = await fetch(`/jobs/${id}/metrics?rank=0&points=1000&limit=100000`);
          return response.ok ? (await response.json()).data : [];
        } catch (err) { return []; }
      }));
      for (const element of document.querySelectorAll(".chart[data-metric]")) {
        const key = element.dataset.metric;
        const tables = runs.map((points) => {
          const kept = points.filter((p) => key in p.values).sort((a, b) => a.step - b.step);
          return [kept.map((p) => p.step), kept.map((p) => p.values[key])];
        });
        const drawn = tables.filter((table) => table[0].length).length;
        element.dataset.series = String(drawn);
        if (!drawn) { element.closest("div").hidden = true; continue; }
        const data = uPlot.join(tables.map((table) => (table[0].length ? table : [[0], [null]])));
        const options = {
          width: Math.max(300, element.clientWidth || 600),
          height: 240,
          scales: { x: { time: false } },
          axes: [{ label: "step" }, {}],
          series: [{ label: "step" }, ...ids.map((id, i) => ({
            label: `job ${id}`, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true, points: { show: false },
          }))],
        };
        new uPlot(options, data, element);
      }
      setLive(false);
    }
    start();
  }

  // Rows of the queue page picked for comparison: kept across the live part's re-renderings.
  function comparePicker() {
    const picked = new Set();
    const button = document.getElementById("compare-picked");
    function sync() {
      for (const box of document.querySelectorAll("input.pick")) box.checked = picked.has(box.value);
      button.disabled = picked.size < 2;
      button.textContent = picked.size ? `Compare ${picked.size} jobs` : "Compare";
    }
    document.addEventListener("change", (change) => {
      const box = change.target.closest("input.pick");
      if (!box) return;
      if (box.checked) picked.add(box.value); else picked.delete(box.value);
      sync();
    });
    button.addEventListener("click", () => {
      location.href = `/compare?jobs=${[...picked].join(",")}`;
    });
    return sync;
  }

  // -- the sweep page: objective against each parameter, and every trial's curve ---------------------
  function sweepPage() {
    const data = JSON.parse(document.getElementById("sweep-data").textContent);
    const scored = data.trials.filter((t) => t.objective !== null);
    for (const canvas of document.querySelectorAll("canvas.scatter")) {
      const param = canvas.dataset.param;
      const points = scored.filter((t) => param in t.params);
      const numeric = points.every((t) => typeof t.params[param] === "number");
      const labels = numeric ? [] : [...new Set(points.map((t) => JSON.stringify(t.params[param])))];
      const xs = points.map((t) => (numeric ? t.params[param] : labels.indexOf(JSON.stringify(t.params[param]))));
      const positive = numeric && xs.every((x) => x > 0);
      const spread = positive && Math.max(...xs) / Math.min(...xs) > 50; // a log axis for lr-like ranges
      const fx = (x) => (spread ? Math.log10(x) : x);
      const ys = points.map((t) => t.objective);
      canvas.dataset.points = String(points.length);
      const ctx = canvas.getContext("2d");
      ctx.clearRect(0, 0, canvas.width, canvas.height);
      if (!points.length) continue;
      const x0 = Math.min(...xs.map(fx)), x1 = Math.max(...xs.map(fx)), y0 = Math.min(...ys), y1 = Math.max(...ys);
      const px = (x) => 30 + ((fx(x) - x0) / (x1 - x0 || 1)) * (canvas.width - 50);
      const py = (y) => canvas.height - 25 - ((y - y0) / (y1 - y0 || 1)) * (canvas.height - 45);
      ctx.fillStyle = "#6b7280";
      ctx.font = "10px sans-serif";
      ctx.fillText(`${y1.toPrecision(3)}`, 2, 15);
      ctx.fillText(`${y0.toPrecision(3)}`, 2, canvas.height - 25);
      ctx.fillText(spread ? "log scale" : numeric ? "" : labels.join("  "), 30, canvas.height - 5);
      points.forEach((t, i) => {
        ctx.fillStyle = t.job === data.best ? COLORS[1] : COLORS[0];
        ctx.beginPath();
        ctx.arc(px(xs[i]), py(ys[i]), t.job === data.best ? 5 : 3.5, 0, 2 * Math.PI);
        ctx.fill();
      });
    }

    async function curves() {
      const element = document.getElementById("trials-chart");
      const runs = await Promise.all(data.trials.map(async (t) => {
        try {
          const response = await fetch(`/jobs/${t.job}/metrics?rank=0&points=300&limit=100000`);
          return response.ok ? (await response.json()).data : [];
        } catch (err) { return []; }
      }));
      const tables = runs.map((points) => {
        const kept = points.filter((p) => data.metric in p.values).sort((a, b) => a.step - b.step);
        return kept.length ? [kept.map((p) => p.step), kept.map((p) => p.values[data.metric])] : [[0], [null]];
      });
      element.dataset.series = String(runs.filter((points) => points.some((p) => data.metric in p.values)).length);
      if (!tables.length) return;
      const options = {
        width: Math.max(300, element.clientWidth || 600),
        height: 280,
        scales: { x: { time: false } },
        axes: [{ label: "step" }, {}],
        series: [{ label: "step" }, ...data.trials.map((t, i) => ({
          label: `trial ${t.trial}`,
          stroke: t.job === data.best ? COLORS[1] : COLORS[(i % (COLORS.length - 2)) + 2],
          width: t.job === data.best ? 3 : 1,
          spanGaps: true,
          points: { show: false },
        }))],
      };
      new uPlot(options, uPlot.join(tables), element);
    }
    curves();
    setLive(false);

    const cancel = document.getElementById("cancel-sweep");
    if (cancel) {
      cancel.addEventListener("click", async () => {
        cancel.disabled = true;
        const response = await fetch(`/sweeps/${document.body.dataset.sweep}/cancel`, {
          method: "POST",
          headers: { "X-CSRF-Token": csrfToken },
        });
        if (!response.ok) {
          let message = `${response.status}`;
          try { message = (await response.json()).message || message; } catch (err) { /* not JSON */ }
          document.getElementById("action-error").textContent = message;
          cancel.disabled = false;
          return;
        }
        location.reload();
      });
    }
  }

  if (page === "queues") queuePage();
  else if (page === "job") jobPage();
  else if (page === "compare") comparePage();
  else if (page === "sweep") sweepPage();
})();
