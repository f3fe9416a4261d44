"""Push a generated H.264 stream in MPEG-TS to a URL (udp://...) at 30 fps for N seconds (test helper)."""
import sys, time, av, numpy as np
url, seconds, fps = sys.argv[1], float(sys.argv[2]), 30
c = av.open(url, mode="w", format="mpegts")
s = c.add_stream("libx264", rate=fps)
s.width, s.height, s.pix_fmt = 160, 120, "yuv420p"
s.options = {"preset": "ultrafast", "tune": "zerolatency", "g": "15", "bf": "0"}
if sys.argv[3:] == ["wait"]:  # started ahead: send once told to (its start-up is not in the test's timing)
    sys.stdin.readline()
t0 = time.time()
i = 0
while time.time() - t0 < seconds:
    img = np.zeros((120, 160, 3), np.uint8); img[:, : (i * 3) % 160] = (200, 50, 50)
    f = av.VideoFrame.from_ndarray(img, format="rgb24"); f.pts = i
    for p in s.encode(f): c.mux(p)
    i += 1
    time.sleep(max(0, t0 + i / fps - time.time()))
for p in s.encode(): c.mux(p)
c.close()
