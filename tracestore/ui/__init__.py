"""The run viewer: ``tracestore ui``, a read-only web view of a server's runs (DESIGN section 16).

Server-rendered HTML with inline SVG plots and no external resource, and
the same data as JSON under ``/api/...``: runs (exact counters, memory,
activity) -> a run (owners and heartbeats, the gate and its recent cycles
with drain times, the replay buffer by task and status with staleness,
release rate) -> a session (its tree, branches and fork reasons) -> a
path's tokens (trained or not, logprob, weight version by staleness, expert
key). It reads only, with the commands of the ``observer`` ACL role, and
never SCANs the keyspace in a request. docs/viewer.md.

Modules: :mod:`.views` (what each page shows), :mod:`.runs` and
:mod:`.sessions` (the data layer: operations that read the store),
:mod:`.html`, :mod:`.html_session` and :mod:`.svg` (rendering),
:mod:`.app` (the aiohttp application; needs the ``gateway`` extra).
``import tracestore`` never imports this package.
"""
