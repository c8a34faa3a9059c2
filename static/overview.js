// Runs overview: click a column header to sort in place (the header links sort on the server when
// scripts are off), type to filter, tick runs and "compare selected" opens them overlaid on one page.
// Sort, filter and selection live in the URL, so the view can be bookmarked.
(function () {
  "use strict";
  const table = document.getElementById("runs-table");
  if (!table) return;
  const headers = Array.from(table.tHead.rows[0].cells);
  const filter = document.getElementById("run-filter");
  const button = document.getElementById("compare-selected");
  const note = document.getElementById("selection-note");
  const bar = document.querySelector(".bar");
  const params = new URLSearchParams(window.location.search);

  function value(row, index, numeric) {
    const raw = row.cells[index].dataset.sort;
    if (raw === undefined || raw === "") return null;
    return numeric ? Number(raw) : raw.toLowerCase();
  }

  function sortBy(th, ascending) {
    const index = headers.indexOf(th);
    const numeric = th.dataset.type === "num";
    const body = table.tBodies[0];
    const rows = Array.from(body.rows);
    rows.sort(function (a, b) {
      const x = value(a, index, numeric);
      const y = value(b, index, numeric);
      if (x === null || y === null) return (x === null) - (y === null);
      const order = x < y ? -1 : x > y ? 1 : 0;
      return ascending ? order : -order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
    headers.forEach(function (h) {
      if (!h.dataset.key) return;
      h.removeAttribute("aria-sort");
      h.querySelector(".arrow").textContent = "";
    });
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    th.querySelector(".arrow").textContent = ascending ? " \u25B2" : " \u25BC";
  }

  function picked() {
    return Array.from(table.querySelectorAll("input.pick:checked")).map(function (box) { return box.value; });
  }

  function writeURL() {
    const url = new URL(window.location.href);
    if (filter.value) url.searchParams.set("q", filter.value); else url.searchParams.delete("q");
    const names = picked();
    if (names.length) url.searchParams.set("selected", names.join(",")); else url.searchParams.delete("selected");
    window.history.replaceState(null, "", url);
  }

  function applyFilter() {
    const words = filter.value.toLowerCase().split(/\s+/).filter(Boolean);
    Array.from(table.tBodies[0].rows).forEach(function (row) {
      row.hidden = !words.every(function (w) { return row.dataset.search.includes(w); });
    });
  }

  function updateSelection() {
    const names = picked();
    button.disabled = names.length < 1;
    note.textContent = names.length ? names.length + " selected: " + names.join(", ") : "tick runs to compare them";
  }

  headers.forEach(function (th) {
    const link = th.querySelector("a");
    if (!link) return;
    link.addEventListener("click", function (event) {
      event.preventDefault();
      const current = th.getAttribute("aria-sort");
      const ascending = current ? current !== "ascending" : th.dataset.type !== "num";
      sortBy(th, ascending);
      const url = new URL(window.location.href);
      url.searchParams.set("sort", th.dataset.key);
      url.searchParams.set("order", ascending ? "asc" : "desc");
      window.history.replaceState(null, "", url);
    });
  });
  filter.addEventListener("input", function () { applyFilter(); writeURL(); });
  table.addEventListener("change", function (event) {
    if (event.target.classList.contains("pick")) { updateSelection(); writeURL(); }
  });
  button.addEventListener("click", function () {
    const names = picked();
    const query = new URLSearchParams();
    query.set("run", names[0]);
    if (names.length > 1) query.set("compare", names.slice(1).join(","));
    query.set("tab", params.get("tab") || "charts");
    if (bar.dataset.token) query.set("token", bar.dataset.token);
    window.location.href = bar.dataset.index + "?" + query.toString();
  });

  filter.value = params.get("q") || "";
  const selected = (params.get("selected") || "").split(",").filter(Boolean);
  table.querySelectorAll("input.pick").forEach(function (box) { box.checked = selected.includes(box.value); });
  applyFilter();
  updateSelection();
})();
