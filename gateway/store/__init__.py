"""The gateway's durable state: file and batch records in a SQL database, file bytes in a blob directory.

Nothing here lives in the gateway process: any replica that opens the same database and blob directory sees
the same files and batches, and a process that dies loses nothing that was committed.
"""
