"""Fine-tuning: OpenAI's ``/v1/fine_tuning/jobs`` on this server's own GPU time. A job trains a
LoRA adapter on a chat model from a JSONL file of conversations, at the batch tier (only while the
GPU is otherwise idle, yielding at the next optimizer step when anyone else arrives), and writes it
into the model's adapter folder, where requests can name it at once. Beside the gateway, as
``batch`` is: it owns the jobs (``tuning.store``), their API (``tuning.api``), the files' checks
(``tuning.data``) and the loop that runs them (``tuning.runner``); the training itself is the
trainer worker's (``workers.trainer``)."""
