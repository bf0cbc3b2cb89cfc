"""The OpenAI Batch API beside the gateway: ``api`` (the HTTP routes of /v1/files, /v1/uploads and
/v1/batches), ``message_batches`` (Anthropic's Message Batches API on the same batches),
``uploads`` (an upload's record and parts until it is completed), ``lines`` (checking an input
file's lines), ``endpoints`` (what a line can call: the gateway's
serving cores, results serialised for the output file), ``runner`` (claims, runs and records
lines at the batch tier) and the stores (``store``: the interface; ``sqlite_store``,
``redis_store``).

``batch`` imports the gateway's serving core and services; of the gateway only ``gateway.app``,
which builds the application, imports ``batch`` (to mount its routes and start its runner)."""
