#!/usr/bin/env python3
"""A TCP proxy on loopback that counts the bytes each way, for tests that check what crosses
the wire (compression). Listens on a free port of 127.0.0.1, prints "port N" on its first line,
forwards every connection to 127.0.0.1:TARGET_PORT, and after each connection closes rewrites
COUNTS_FILE with "up DOWN" totals: bytes client→server and server→client since it started.
Exits after --seconds (a bound on the test, not a timing).

usage: byte_counting_proxy.py TARGET_PORT COUNTS_FILE [--seconds=300]
"""
import argparse
import asyncio
import os
import sys


async def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("target_port", type=int)
    parser.add_argument("counts_file")
    parser.add_argument("--seconds", type=float, default=300)
    args = parser.parse_args()
    totals = {"up": 0, "down": 0}

    def record():
        temporary = args.counts_file + ".tmp"
        with open(temporary, "w") as f:
            f.write(f"{totals['up']} {totals['down']}\n")
        os.replace(temporary, args.counts_file)

    async def pipe(reader, writer, direction):
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                totals[direction] += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            try:
                writer.close()
            except Exception:
                pass

    async def handle(client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1",
                                                                     args.target_port)
        await asyncio.gather(pipe(client_reader, server_writer, "up"),
                             pipe(server_reader, client_writer, "down"))
        record()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    record()
    print(f"port {port}", flush=True)
    async with server:
        await asyncio.sleep(args.seconds)


if __name__ == "__main__":
    asyncio.run(main())
