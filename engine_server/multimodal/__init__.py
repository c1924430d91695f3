"""Images as input: the bytes of a chat turn's images decoded and prepared as the model's processor does
(`processing`), their placeholder tokens laid into the prompt (`inputs`), and the vision encoder that turns them into
the text model's embeddings (`llava`), which the model runner lays over the placeholders' rows."""
