// The dashboard's one piece of script: an API key (when the coordinator has --api-key-file)
// goes with every fragment request; a 401 shows the key box. The key stays in this tab.
(function () {
  var KEY = "cellswarm-api-key";
  document.addEventListener("htmx:configRequest", function (e) {
    var key = sessionStorage.getItem(KEY);
    if (key) e.detail.headers["Authorization"] = "Bearer " + key;
  });
  document.addEventListener("htmx:responseError", function (e) {
    if (e.detail.xhr.status === 401 || e.detail.xhr.status === 403) {
      document.getElementById("key-form").hidden = false;
    }
  });
  document.addEventListener("DOMContentLoaded", function () {
    document.getElementById("key-form").addEventListener("submit", function (e) {
      e.preventDefault();
      sessionStorage.setItem(KEY, document.getElementById("key").value);
      document.getElementById("key-form").hidden = true;
      htmx.trigger(document.body, "htmx:load");
    });
  });
})();
