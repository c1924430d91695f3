def main() -> None:
    print("ladle")
