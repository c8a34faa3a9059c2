// Runs overview: clicking a column header sorts the table in place (the header links do the same
// on the server when scripts are off). Numbers sort as numbers; empty cells stay last.
(function () {
  "use strict";
  const table = document.getElementById("runs-table");
  if (!table) return;
  const headers = Array.from(table.tHead.rows[0].cells);

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
      h.removeAttribute("aria-sort");
      h.querySelector(".arrow").textContent = "";
    });
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    th.querySelector(".arrow").textContent = ascending ? " \u25B2" : " \u25BC";
  }

  headers.forEach(function (th) {
    th.querySelector("a").addEventListener("click", function (event) {
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
})();
