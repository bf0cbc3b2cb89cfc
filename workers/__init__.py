"""One module per modality (chat, image, tts, stt): loading a model from its local folder in its
library's own format, running it in steps with a yield point between steps, and building the
tiny offline demo models."""
