"""The OpenAI HTTP gateway: a stateless FastAPI app that turns OpenAI API calls into calls on ladle engines."""
