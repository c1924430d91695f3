"""HTTP routers, one per API area; each validates, converts, calls the engines and converts back."""
