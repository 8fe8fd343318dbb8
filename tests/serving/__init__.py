"""The tests of the OpenAI server (serving/): HTTP on real sockets, the API's fields and answers, the
engine behind it, tenants and keys, sampling extras, tokens to text, and n as the engine's forks."""
