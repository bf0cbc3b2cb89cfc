"""One module per modality (chat on transformers or vLLM, image, tts, stt, embed, moderation,
rerank): loading a model from its local folder in its library's own format and running it in
steps with a yield point between steps. Every worker implements the interface in ``workers.worker`` (what the arbiter calls to move
its weights, and what the gateway may know before loading); ``workers.registry`` picks the class
for a model spec; ``workers.sharing`` lets concurrent requests share one run (the encoders'
passes, speech-to-text's decodes); ``workers.reaper`` ends the processes an engine starts when the serving process
dies without stopping them."""
