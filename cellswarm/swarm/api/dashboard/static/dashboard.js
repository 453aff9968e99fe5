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

// The charts' time range (its buttons re-fetch the panel; the poll keeps the choice), and
// the chat box: one question to the swarm's OpenAI chat route, the answer streamed in.
(function () {
  var KEY = "cellswarm-api-key";
  document.addEventListener("click", function (e) {
    var range = e.target.getAttribute && e.target.getAttribute("data-range");
    if (!range) return;
    window.cellswarmRange = parseInt(range, 10);
    htmx.trigger(document.getElementById("throughput"), "refresh");
  });
  function headers() {
    var h = {"Content-Type": "application/json"};
    var key = sessionStorage.getItem(KEY);
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }
  async function ask(e) {
    e.preventDefault();
    var form = document.getElementById("chat-form");
    var out = document.getElementById("chat-answer");
    var status = document.getElementById("chat-status");
    var text = document.getElementById("chat-input").value.trim();
    if (!text) return;
    out.textContent = "";
    status.textContent = "asking…";
    var body = {model: form.dataset.model, stream: true, max_tokens: 128, temperature: 0,
                messages: [{role: "user", content: text}]};
    try {
      var r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
                                                   body: JSON.stringify(body)});
      if (!r.ok) {
        var err = await r.json();
        status.textContent = (err.error && err.error.message) || ("HTTP " + r.status);
        return;
      }
      var reader = r.body.getReader(), decoder = new TextDecoder(), buf = "";
      for (;;) {
        var chunk = await reader.read();
        if (chunk.done) break;
        buf += decoder.decode(chunk.value, {stream: true});
        var lines = buf.split("\n");
        buf = lines.pop();
        lines.forEach(function (line) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") return;
          var data = JSON.parse(line.slice(6));
          if (data.error) { status.textContent = data.error.message; return; }
          var delta = data.choices && data.choices[0] && data.choices[0].delta;
          if (delta && delta.content) out.textContent += delta.content;
        });
      }
      status.textContent = "done";
    } catch (x) {
      status.textContent = String(x);
    }
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.getElementById("chat-form").addEventListener("submit", ask);
  });
})();
